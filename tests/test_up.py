"""``lorabus up`` runs the demo end to end and leaves no process behind.

Each run gets a unique marker variable in its environment, which every process
it starts (nats-server included) inherits; after ``up`` exits, no live process
may still carry the marker in ``/proc/<pid>/environ``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from processes import LORABUS, child_env, pids_marked

MARK_VAR = "LORABUS_TEST_MARK"
#: Only deadlines, so that a stuck run fails the test instead of hanging it.
RUN_DEADLINE_S = 60.0
STOP_DEADLINE_S = 20.0

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")


def _describe(pids: list[int]) -> str:
    lines = []
    for pid in pids:
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            lines.append(f"{pid}: {cmdline.decode(errors='replace')}")
    return "\n".join(lines) or "(gone)"


@pytest.fixture
def marker() -> Iterator[str]:
    """A marker unique to this test; whatever still carries it at teardown is killed."""
    mark = uuid.uuid4().hex
    yield mark
    for pid in pids_marked(MARK_VAR, mark):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class _Up:
    """One ``lorabus up`` process with its stdout read line by line."""

    def __init__(self, process: asyncio.subprocess.Process, stderr_path: Path) -> None:
        self.process = process
        self.stderr_path = stderr_path
        self.lines: list[str] = []

    @classmethod
    async def start(cls, marker: str, stderr_path: Path, *args: str) -> _Up:
        with stderr_path.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                str(LORABUS),
                "up",
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                # Unbuffered, so each step line arrives as it is printed.
                env=child_env({MARK_VAR: marker, "PYTHONUNBUFFERED": "1"}),
            )
        return cls(process, stderr_path)

    def output(self) -> str:
        stderr = self.stderr_path.read_text(errors="replace")
        return "stdout:\n" + "\n".join(self.lines) + f"\nstderr:\n{stderr}"

    async def read_until(self, pattern: str, deadline_s: float) -> None:
        """Read stdout until a line matches ``pattern``; fail at EOF or the deadline."""
        assert self.process.stdout is not None
        try:
            async with asyncio.timeout(deadline_s):
                while True:
                    raw = await self.process.stdout.readline()
                    if not raw:
                        raise AssertionError(f"no line matching {pattern!r}:\n{self.output()}")
                    self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                    if re.search(pattern, self.lines[-1]):
                        return
        except TimeoutError:
            raise AssertionError(
                f"no line matching {pattern!r} within {deadline_s:.0f}s:\n{self.output()}"
            ) from None

    async def finish(self, deadline_s: float) -> int:
        """Read the rest of stdout and wait for the exit; fail at the deadline."""
        assert self.process.stdout is not None
        try:
            async with asyncio.timeout(deadline_s):
                rest = await self.process.stdout.read()
                self.lines.extend(rest.decode(errors="replace").splitlines())
                return await self.process.wait()
        except TimeoutError:
            raise AssertionError(
                f"lorabus up did not exit within {deadline_s:.0f}s:\n{self.output()}"
            ) from None

    async def kill(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        await self.process.wait()


StartUp = Callable[..., Awaitable[_Up]]


@pytest.fixture
async def up(marker: str, tmp_path: Path) -> AsyncIterator[StartUp]:
    """Starts ``lorabus up <args>``; every run is killed and waited for at teardown."""
    runs: list[_Up] = []

    async def start(*args: str) -> _Up:
        run = await _Up.start(marker, tmp_path / f"up-{len(runs)}.stderr", *args)
        runs.append(run)
        return run

    yield start
    for run in runs:
        await run.kill()


async def test_up_commits_three_steps_prints_a_rank_map_and_leaves_nothing_running(
    up: StartUp, marker: str
) -> None:
    run = await up()

    returncode = await run.finish(RUN_DEADLINE_S)

    assert returncode == 0, run.output()
    steps = [line for line in run.lines if re.match(r"step \d+: committed\b", line)]
    assert len(steps) == 3, run.output()
    assert any(line.startswith("rank map:") for line in run.lines), run.output()
    # Versions beyond --keep 2 are retired by the agents before the summary.
    assert any(
        line.startswith("summary: 3/3 updates committed; engines now serve policy-v2, policy-v3;")
        for line in run.lines
    ), run.output()
    assert re.fullmatch(r"audit: \d+ records, 0 violation\(s\)", run.lines[-1]), run.output()
    leftovers = pids_marked(MARK_VAR, marker)
    assert not leftovers, f"still running after lorabus up exited:\n{_describe(leftovers)}"


async def test_up_interrupted_by_sigint_exits_and_leaves_nothing_running(
    up: StartUp, marker: str
) -> None:
    run = await up("--steps", "100")
    await run.read_until(r"^step 1:", RUN_DEADLINE_S)
    # The marker does reach the children: the check below is not vacuous.
    assert "nats-server" in _describe(pids_marked(MARK_VAR, marker)), run.output()

    run.process.send_signal(signal.SIGINT)
    returncode = await run.finish(STOP_DEADLINE_S)

    # It exited by itself (a death by the signal would be negative), before the end.
    assert returncode >= 0, run.output()
    assert not any(line.startswith("step 100:") for line in run.lines), run.output()
    leftovers = pids_marked(MARK_VAR, marker)
    assert not leftovers, f"still running after lorabus up exited:\n{_describe(leftovers)}"


async def test_up_with_three_tenants_commits_each_trainers_steps_and_keeps_each_adapter(
    up: StartUp, marker: str
) -> None:
    run = await up("--tenants", "3", "--steps", "2")

    returncode = await run.finish(RUN_DEADLINE_S)

    assert returncode == 0, run.output()
    for tenant in ("tenant-1", "tenant-2", "tenant-3"):
        steps = [line for line in run.lines if re.match(rf"{tenant} step \d: committed\b", line)]
        assert len(steps) == 2, run.output()
    serving = ", ".join(f"tenant-{n}-v{v}" for n in (1, 2, 3) for v in (1, 2))
    assert any(
        line.startswith(f"summary: 6/6 updates committed; engines now serve {serving};")
        for line in run.lines
    ), run.output()
    assert re.fullmatch(r"audit: \d+ records, 0 violation\(s\)", run.lines[-1]), run.output()
    assert not pids_marked(MARK_VAR, marker)
