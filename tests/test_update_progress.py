"""``lorabus update`` at a terminal says where its update stands on stderr
(quorum, each phase, who is still awaited); for scripts (stdout not a
terminal, or ``--json``) it says nothing there."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pty
import re
from collections.abc import AsyncIterator, Callable

import pytest
from processes import LORABUS, child_env, run_lorabus

from lorabus.audit.render import status_text, update_progress_text
from lorabus.schemas import FleetStatus, MemberStatus, RunningUpdate
from lorabus.testbed.stack import EmbeddedStack

PROGRESS = re.compile(r"^update step-\d+: ", re.MULTILINE)


@pytest.fixture
async def stack(make_stack: Callable[..., EmbeddedStack]) -> AsyncIterator[EmbeddedStack]:
    async with make_stack([1, 1]) as started:
        assert started.sim is not None
        # w001 loads slowly, so the load phase waits on it for a few status polls.
        started.sim.workers["w001"].set_faults(latency_s={"load": 4.0})
        yield started


async def _update_at_a_terminal(*args: str) -> tuple[int, str, str]:
    """Run ``lorabus update <args>`` with stdout on a pseudo-terminal; return its
    exit code, what reached the terminal, and its stderr."""
    controller, terminal = pty.openpty()
    try:
        process = await asyncio.create_subprocess_exec(
            LORABUS,
            "update",
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=terminal,
            stderr=asyncio.subprocess.PIPE,
            env=child_env(None),
        )
        os.close(terminal)
        terminal = -1
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), 60)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        shown = b""
        with contextlib.suppress(OSError):  # EIO once the terminal's last writer is gone
            while chunk := os.read(controller, 65536):
                shown += chunk
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)
    assert process.returncode is not None
    return process.returncode, shown.decode(errors="replace"), stderr.decode(errors="replace")


async def test_at_a_terminal_progress_names_the_phase_and_who_is_awaited(
    stack: EmbeddedStack, nats_url: str, fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    code, shown, stderr = await _update_at_a_terminal(
        "--nats",
        nats_url,
        "--fleet",
        fleet_name,
        "--adapter",
        "policy",
        "--path",
        make_adapter(1),
        "--version",
        "1",
        "--update-id",
        "step-1",
    )

    assert code == 0, (shown, stderr)
    assert "COMMITTED" in shown, shown
    assert re.search(
        r"^update step-1: load: \d of 2 acked; waiting for (w000, )?w001$", stderr, re.MULTILINE
    ), stderr
    assert "COMMITTED" not in stderr, "the result goes to stdout only"


async def test_scripts_get_no_progress(
    stack: EmbeddedStack, nats_url: str, fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    common = ("--nats", nats_url, "--fleet", fleet_name, "--adapter", "policy")

    piped = await run_lorabus(
        "update", *common, "--path", make_adapter(1), "--version", "1", "--update-id", "step-1"
    )
    code, shown, stderr = await _update_at_a_terminal(
        *common, "--path", make_adapter(2), "--version", "2", "--update-id", "step-2", "--json"
    )

    assert piped.returncode == 0, piped
    assert not PROGRESS.search(piped.stderr), piped.stderr
    assert code == 0, (shown, stderr)
    assert '"status": "committed"' in shown, shown
    assert not PROGRESS.search(stderr), stderr


def _status(**fields: object) -> FleetStatus:
    members = [
        MemberStatus(
            worker_id=w,
            world_size=1,
            engine="dynamo",
            paused=False,
            adapters=[],
            heartbeat_age_s=0.1,
        )
        for w in ("w000", "w001")
    ]
    return FleetStatus(
        fleet="f", expected_world_size=4, live_world_size=2, members=members, **fields
    )  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (None, "update u1: no coordinator answers status requests right now; still asking"),
        (_status(), "update u1: waiting for a coordinator to run it"),
        (_status(in_flight="u0"), "update u1: queued behind update u0"),
        (
            _status(
                in_flight="u0",
                running=[
                    RunningUpdate(update_id="u0", adapter="other", phase="load"),
                    RunningUpdate(update_id="u1", adapter="policy", phase="verify"),
                ],
            ),
            "update u1: verify (beside 1 other update(s) running)",
        ),
        (
            _status(
                in_flight="u0",
                running=[
                    RunningUpdate(update_id="u0", adapter="a"),
                    RunningUpdate(update_id="u2", adapter="b"),
                ],
            ),
            "update u1: queued behind update u0, u2",
        ),
        (_status(in_flight="u1"), "update u1: quorum: live world size 2 of 4 (2 member(s) live)"),
        (
            _status(in_flight="u1", in_flight_phase="pause", acked=["w000"], waiting=["w001"]),
            "update u1: pause: 1 of 2 acked; waiting for w001",
        ),
        (
            _status(
                in_flight="u1",
                in_flight_phase="load",
                acked=[],
                waiting=[f"w{i:03}" for i in range(10)],
            ),
            "update u1: load: 0 of 10 acked; waiting for w000, w001, w002, w003, w004, w005, "
            "w006, w007 and 2 more",
        ),
        (
            _status(in_flight="u1", in_flight_phase="load", acked=[], waiting=["w\x1b[2J"]),
            "update u1: load: 0 of 1 acked; waiting for w\\x1b[2J",
        ),
    ],
)
def test_progress_text(status: FleetStatus | None, expected: str) -> None:
    assert update_progress_text("u1", status).startswith(expected)


def test_the_status_text_lists_every_update_running() -> None:
    running = [
        RunningUpdate(update_id="u0", adapter="policy", phase="load"),
        RunningUpdate(update_id="u2", adapter="other", live=True),
    ]
    text = status_text(_status(in_flight="u0", in_flight_phase="load", running=running), now=0)

    assert "update in flight: u0: load" in text
    assert "also running: u2 (other, quorum)" in text
