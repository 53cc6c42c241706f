"""Running lorabus parts as real OS processes in tests, and always stopping them.

:class:`Processes` starts ``lorabus agent`` / ``lorabus coordinator`` (or any
``lorabus`` subcommand) as children of the test, each with its stderr in a file
under the test's tmp dir, and stops every one of them on exit, also when the
test fails: SIGTERM, then SIGKILL after a deadline, and always a wait, so no
child outlives its test (see :mod:`lorabus.testbed.child_processes`). The ``processes``
fixture of ``conftest.py`` gives each test one. Command lines come from
configs (:mod:`lorabus.service_flags`), as the testbed builds them.

:func:`run_lorabus` runs one short-lived command (``update``, ``status``,
``schema``) to completion with a deadline. :func:`wait_live_workers` polls a
coordinator's status until a given set of workers is live, and fails with what
it last saw (and the stderr of any child that died) instead of hanging.

Everything here is asyncio, so an in-process simulated fleet or coordinator
keeps being served while the children run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lorabus.agents import AgentConfig
from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from lorabus.errors import NoCoordinator
from lorabus.schemas import FleetStatus, UpdateMode
from lorabus.service_flags import agent_args, coordinator_args
from lorabus.simfleet import SimFleet
from lorabus.testbed.child_processes import LORABUS, ChildGroup, ChildProcess, child_env


class Processes(ChildGroup[ChildProcess]):
    """Starts lorabus children and guarantees every one is stopped on exit."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__()
        self.log_dir = log_dir

    async def start(
        self,
        name: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str | None] | None = None,
        launcher: Sequence[str] = (),
    ) -> ChildProcess:
        """Start ``lorabus --log-level INFO <args>``; stderr goes to ``<log_dir>/<name>.log``.
        ``launcher`` runs before it and must exec it (so signals reach lorabus)."""
        argv = [*launcher, LORABUS, "--log-level", "INFO", *args]
        child = await ChildProcess.spawn(
            name, argv, self.log_dir / f"{name}.log", env=child_env(env)
        )
        return self.adopt(child)

    async def start_agent(
        self,
        config: AgentConfig,
        *,
        nats_url: str,
        extra: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
        launcher: Sequence[str] = (),
    ) -> ChildProcess:
        """``lorabus agent`` for ``config``; ``extra`` carries auth and metrics flags."""
        args = agent_args(config, nats_url=nats_url, extra=extra)
        return await self.start(f"agent-{config.worker_id}", args, env=env, launcher=launcher)

    async def start_agents(
        self,
        world_sizes: Mapping[str, int],
        system_url: Callable[[str], str],
        *,
        fleet: str,
        nats_url: str,
        extra: Sequence[str] = (),
        env_of: Callable[[str], Mapping[str, str | None]] = lambda _worker: {},
        frontend_url: str = "",
        frontend_discovery_url: str = "",
    ) -> dict[str, ChildProcess]:
        """One ``lorabus agent`` per worker of ``world_sizes`` (fast heartbeats),
        each at ``system_url(worker)``, with ``env_of(worker)`` (an identity, say);
        ``frontend_url``: where a Dynamo worker's canary generates, and
        ``frontend_discovery_url`` where that frontend serves its workers."""
        started = {}
        for worker_id, world_size in world_sizes.items():
            config = AgentConfig(
                fleet=fleet,
                worker_id=worker_id,
                system_url=system_url(worker_id),
                frontend_url=frontend_url,
                frontend_discovery_url=frontend_discovery_url,
                world_size=world_size,
                heartbeat_s=0.2,
            )
            started[worker_id] = await self.start_agent(
                config, nats_url=nats_url, extra=extra, env=env_of(worker_id)
            )
        return started

    async def start_coordinator(
        self,
        config: CoordinatorConfig,
        *,
        nats_url: str,
        extra: Sequence[str] = (),
        env: Mapping[str, str | None] | None = None,
    ) -> ChildProcess:
        """``lorabus coordinator`` for ``config``; ``extra`` carries auth and metrics flags."""
        args = coordinator_args(config, nats_url=nats_url, extra=extra)
        return await self.start(f"coordinator-{config.holder or config.fleet}", args, env=env)

    async def start_failover_fleet(
        self,
        sim: SimFleet,
        world_sizes: Mapping[str, int],
        *,
        fleet: str,
        nats_url: str,
        leader_lease_s: float,
        mode: UpdateMode = UpdateMode.PAUSE,
    ) -> dict[str, ChildProcess]:
        """A fleet that can fail over: coordinators ``c1`` and ``c2`` (one leads,
        the other stands by) and one agent per worker of ``sim``."""
        coordinators = {}
        for holder in ("c1", "c2"):
            config = CoordinatorConfig(
                fleet=fleet,
                frontend_url=sim.url,
                expected_world_size=sum(world_sizes.values()),
                holder=holder,
                leader_lease_s=leader_lease_s,
                phase_timeout_s=20,
                pause_lease_s=10,
                mode=mode,
            )
            coordinators[holder] = await self.start_coordinator(config, nats_url=nats_url)
        await self.start_agents(
            world_sizes, sim.system_url, frontend_url=sim.url, fleet=fleet, nats_url=nats_url
        )
        return coordinators

    def check_alive(self) -> None:
        """Fail with its stderr if a child died that the test did not stop."""
        dead = [p for p in self.children if not p.running and not p.ended_on_purpose]
        if dead:
            raise AssertionError("child process died:\n" + "\n".join(p.describe() for p in dead))


def pids_marked(variable: str, marker: str) -> list[int]:
    """Live processes (other than this one) whose environment has ``variable=marker``:
    a test marks what it starts, to find anything left behind."""
    needle = f"{variable}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


@dataclass
class Finished:
    """A ``lorabus`` command that ran to completion."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str = field(repr=False)

    def __str__(self) -> str:
        return (
            f"{' '.join(self.argv)} -> exit {self.returncode}\n"
            f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}"
        )


async def run_lorabus(
    *args: str, env: Mapping[str, str | None] | None = None, deadline_s: float = 60.0
) -> Finished:
    """Run ``lorabus <args>`` to completion without blocking the event loop.

    Past ``deadline_s`` the command is killed and the test fails with its output.
    """
    argv = [LORABUS, *args]
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=child_env(env),
    )
    communicating = asyncio.ensure_future(process.communicate())
    try:
        stdout, stderr = await asyncio.wait_for(asyncio.shield(communicating), deadline_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        stdout, stderr = await communicating
        raise AssertionError(
            f"{' '.join(argv)} did not finish within {deadline_s:.0f}s; killed.\n"
            f"stdout:\n{stdout.decode(errors='replace')}\n"
            f"stderr:\n{stderr.decode(errors='replace')}"
        ) from None
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await communicating
    assert process.returncode is not None
    return Finished(
        argv, process.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace")
    )


async def wait_live_workers(
    client: UpdateClient,
    expected: Collection[str],
    *,
    deadline_s: float = 15.0,
    processes: Processes | None = None,
    poll_s: float = 0.05,
) -> FleetStatus:
    """Poll the coordinator's status until its live members are exactly ``expected``.

    Keeps asking while no coordinator answers yet. Fails at once if one of
    ``processes`` died, and at the deadline with the last status or error seen.
    """
    want = set(expected)
    last_seen = "nothing yet"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while True:
        if processes is not None:
            processes.check_alive()
        remaining = deadline - loop.time()
        if remaining <= 0:
            children = (
                "\n" + "\n".join(p.describe() for p in processes.children)
                if processes is not None
                else ""
            )
            raise AssertionError(
                f"live workers on fleet {client.subjects.fleet!r} were not {sorted(want)} "
                f"within {deadline_s:.0f}s; last seen: {last_seen}{children}"
            )
        try:
            status = await client.status(timeout_s=max(min(remaining, 1.0), 0.1))
        except NoCoordinator as exc:
            last_seen = str(exc)
        else:
            live = {member.worker_id for member in status.members}
            if live == want:
                return status
            last_seen = f"live {sorted(live)}"
        await asyncio.sleep(poll_s)


def run_marked(argv: list[str], deadline_s: float) -> tuple[int, str, list[int]]:
    """Run ``argv`` to its end (interrupted at ``deadline_s``), every process
    it starts marked: its exit code, its output, and the pids of those that
    outlived it, killed here after they were counted."""
    variable, marker = "LORABUS_TEST_MARK", uuid.uuid4().hex

    async def run() -> tuple[int, str]:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=child_env({variable: marker}),
        )
        try:
            stdout, _ = await asyncio.wait_for(process.communicate(), deadline_s)
        except TimeoutError:
            process.send_signal(signal.SIGINT)
            stdout, _ = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode is not None
        return process.returncode, stdout.decode(errors="replace")

    code, text = asyncio.run(run())
    left = pids_marked(variable, marker)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return code, text, left
