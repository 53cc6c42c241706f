"""The real agents and the real coordinator of one fleet, on the in-memory bus.

Nothing here re-implements either: each :class:`~lorabus.agents.Agent` and
the :class:`~lorabus.coordinator.service.Coordinator` run as they do in
production, on :class:`~memory_bus.MemoryNats` connections of one
:class:`~memory_bus.MemoryServer`, so a test can run on looptime's fake clock.
What is in memory is what is not the agent nor the coordinator: the engines
(:class:`MemoryEngine`, with faults), the frontend (lists what any engine
holds, as Dynamo's union of workers does) and the requester (the real
:class:`~lorabus.client.UpdateClient` on a connection of its own). A tap
connection records every command, so a test can say what a worker was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from memory_bus import MemoryNats, MemoryServer

from lorabus.agents import Agent, CommandExecutor
from lorabus.agents.node import NodeAgent
from lorabus.client import UpdateClient
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.service import Coordinator
from lorabus.errors import CanaryFailed, EngineError, FrontendUnverified
from lorabus.schemas import (
    Ack,
    Command,
    Phase,
    Subjects,
    UpdateRequest,
    ack_decoder,
    ack_message_decoder,
    command_decoder,
    is_addressed_to,
    phase_of,
    reports_of,
    update_request_decoder,
)

HEARTBEAT_S = 0.2


@dataclass
class MemoryEngine:
    """An inference engine in memory (an :class:`~lorabus.agents.EngineDriver`)."""

    kind: str = "memory"
    adapters: list[str] = field(default_factory=list)
    paused: bool = False
    fail_load: bool = False
    fail_pause: bool = False
    on_load: Callable[[], Awaitable[None]] | None = None
    """Runs at the start of every load (a hang, a crash of the worker)."""
    on_pause: Callable[[], Awaitable[None]] | None = None
    """Runs at the start of every pause (a hang)."""
    refused: tuple[str, ...] = ()
    """Served names whose load fails, by prefix (one adapter's versions)."""
    calls: list[str] = field(default_factory=list)
    """What the engine was asked, in order: "pause", "resume", "load", "unload"."""
    unroutable: set[str] = field(default_factory=set)
    """Names it lists but does not serve: a generation with one fails."""
    canaries: list[str] = field(default_factory=list)
    """Every name it was asked to generate with, in order."""

    async def pause(self) -> None:
        self.calls.append("pause")
        if self.on_pause is not None:
            await self.on_pause()
        if self.fail_pause:
            raise EngineError("cannot pause")
        self.paused = True

    async def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    async def load_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        self.calls.append("load")
        if self.on_load is not None:
            await self.on_load()
        if self.fail_load or name.startswith(self.refused or ("\0",)):
            raise EngineError(f"cannot load {name}")
        if name not in self.adapters:
            self.adapters.append(name)

    async def unload_adapter(self, name: str) -> None:
        self.calls.append("unload")
        self.adapters = [a for a in self.adapters if a != name]

    async def list_adapters(self) -> list[str]:
        return list(self.adapters)

    async def canary(self, name: str, *, budget_s: float) -> str:
        self.canaries.append(name)
        if self.paused:
            raise CanaryFailed(f"a paused engine was asked to generate with {name!r}")
        if name not in self.adapters or name in self.unroutable:
            raise CanaryFailed(f"the model `{name}` does not exist")
        return " Paris"

    async def aclose(self) -> None:
        return None


class ListingFrontend:
    def __init__(self, engines: Mapping[str, MemoryEngine]) -> None:
        self.engines = engines
        self.first_look: list[str] | None = None
        """Who held the model when the frontend was first asked."""
        self.holds: dict[str, asyncio.Event] = {}
        """Models, by prefix, that the frontend does not list until their event is set."""
        self.asked: list[str] = []
        """Every model asked for, in order."""
        self.generated: list[str] = []
        """Every model a generation was asked of, in order."""
        self.unanswered: set[str] = set()
        """Models it lists but does not route a generation of."""

    async def generate(self, model: str, timeout_s: float) -> str:
        self.generated.append(model)
        routable = [e for e in self.engines.values() if model not in e.unroutable]
        if model in self.unanswered or not any(model in e.adapters for e in routable):
            raise CanaryFailed(f"the frontend did not answer a generation as {model!r}")
        return " Paris"

    async def wait_listed(self, model: str, timeout_s: float) -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        if self.first_look is None:
            self.first_look = sorted(w for w, e in self.engines.items() if model in e.adapters)
        self.asked.append(model)
        for prefix, released in list(self.holds.items()):
            if model.startswith(prefix):
                try:
                    await asyncio.wait_for(released.wait(), timeout_s)
                except TimeoutError:
                    raise FrontendUnverified(f"{model!r} held past {timeout_s:.1f}s") from None
        while not any(model in engine.adapters for engine in self.engines.values()):
            if loop.time() - started >= timeout_s:
                raise FrontendUnverified(f"{model!r} not listed within {timeout_s:.1f}s")
            await asyncio.sleep(0.02)
        return loop.time() - started


class InMemoryFleet:
    """A coordinator and one agent per worker on one :class:`MemoryServer`."""

    def __init__(
        self,
        world_sizes: Mapping[str, int],
        *,
        fleet: str = "memory",
        labels: Mapping[str, Mapping[str, str]] | None = None,
        **settings: Any,
    ) -> None:
        """``labels``: what each worker's agent announces, by worker id."""
        self.server = MemoryServer()
        self.labels = {wid: dict(given) for wid, given in (labels or {}).items()}
        self.subjects = Subjects(fleet=fleet)
        self.world_sizes = dict(world_sizes)
        self.engines = {wid: MemoryEngine() for wid in world_sizes}
        self.frontend = ListingFrontend(self.engines)
        settings.setdefault("expected_world_size", sum(world_sizes.values()))
        settings.setdefault("holder", "c1")
        self.config = CoordinatorConfig(
            fleet=fleet, frontend_url="http://frontend.invalid", **settings
        )
        self.coordinator = Coordinator(self.config, frontend=self.frontend)
        self.coordinators: dict[str, Coordinator] = {}
        """Every coordinator started, by holder (the first is :attr:`coordinator`)."""
        self.connections: dict[str, MemoryNats] = {}
        self.agents: dict[str, Agent] = {}
        self.commands: list[tuple[str, Command]] = []
        """(subject, command) of every command sent, in order."""
        self.acks: list[Ack] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._agent_tasks: dict[str, asyncio.Task[None]] = {}

    async def __aenter__(self) -> InMemoryFleet:
        tap = self.server.connect("tap")
        await tap.subscribe(f"{self.subjects.cmd()}.>", cb=self._on_command)
        await tap.subscribe(self.subjects.cmd(), cb=self._on_command)
        await tap.subscribe(self.subjects.ack_any(), cb=self._on_ack)
        await self._run_coordinator(self.coordinator, "coordinator")
        await asyncio.wait_for(self.coordinator.leading.wait(), timeout=30)
        for wid, size in self.world_sizes.items():
            await self.start_agent(wid, size)
        await self.coordinator.membership.wait_quorum(sum(self.world_sizes.values()), 30)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for task in reversed(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def start_agent(self, worker_id: str, world_size: int) -> Agent:
        """Start ``worker_id``'s agent (on a new engine if it has none yet);
        return it once it reports ready."""
        engine = self.engines.setdefault(worker_id, MemoryEngine())
        conn = self.connections[worker_id] = self.server.connect(worker_id)
        agent = self.agents[worker_id] = Agent(
            self.subjects,
            CommandExecutor(worker_id, world_size, engine),
            heartbeat_s=HEARTBEAT_S,
            labels=self.labels.get(worker_id),
        )
        ready = asyncio.Event()
        self._agent_tasks[worker_id] = self._start(agent.run(conn, ready))  # type: ignore[arg-type]
        await asyncio.wait_for(ready.wait(), timeout=30)
        return agent

    def start_node(
        self, node: str, world_sizes: Mapping[str, int]
    ) -> tuple[NodeAgent, asyncio.Task[None]]:
        """A node agent (agents/node.py) of real agents for ``world_sizes``'s
        workers, on one connection named ``node``; its task, running. A
        worker that has an agent already gets a second one on the same engine
        (two agents claiming one worker id); :attr:`agents` then names the
        node's, and :meth:`kill_agent` is for lone agents only."""
        conn = self.connections[node] = self.server.connect(node)
        agents = []
        for worker_id, world_size in world_sizes.items():
            engine = self.engines.setdefault(worker_id, MemoryEngine())
            agents.append(
                Agent(
                    self.subjects,
                    CommandExecutor(worker_id, world_size, engine),
                    heartbeat_s=HEARTBEAT_S,
                )
            )
            self.agents[worker_id] = agents[-1]
        runner = NodeAgent(node, agents)
        return runner, self._start(runner.run(conn))  # type: ignore[arg-type]

    async def kill_agent(self, worker_id: str) -> None:
        """As SIGKILL would: the process stops at once, with no word to the bus
        and no call to its engine (which stays as it is, paused or not)."""
        self.connections[worker_id].cut()
        self.agents[worker_id].executor.driver = _DeadProcess()
        task = self._agent_tasks.pop(worker_id)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def start_coordinator(self, holder: str, **settings: Any) -> Coordinator:
        """Start another coordinator of this fleet (a standby while the first
        leads); return it once it is up, leading or not."""
        config = msgspec.structs.replace(self.config, holder=holder, **settings)
        coordinator = Coordinator(config, frontend=self.frontend)
        await self._run_coordinator(coordinator, holder)
        return coordinator

    async def _run_coordinator(self, coordinator: Coordinator, connection: str) -> None:
        self.coordinators[coordinator.config.holder] = coordinator
        conn = self.connections[connection] = self.server.connect(connection)
        ready = asyncio.Event()
        self._start(coordinator.run(conn, ready))  # type: ignore[arg-type]
        await asyncio.wait_for(ready.wait(), timeout=30)

    def _start(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.append(task)
        return task

    async def _on_command(self, msg: Any) -> None:
        self.commands.append((msg.subject, command_decoder.decode(msg.data)))

    async def _on_ack(self, msg: Any) -> None:
        # A node's message carries its workers' acks (agents/node.py).
        self.acks.extend(reports_of(ack_message_decoder.decode(msg.data)))

    def requests(self) -> list[UpdateRequest]:
        """Every update request sent (asked again included), in order."""
        subject = self.subjects.update_request()
        return [update_request_decoder.decode(d) for s, d in self.server.published if s == subject]

    def client(self, tenant: str | None = None) -> UpdateClient:
        """A client on a connection of its own (asking as ``tenant``, if given)."""
        conn = self.server.connect(f"client-{tenant}" if tenant else "client")
        return UpdateClient(conn, self.subjects.fleet, tenant=tenant)  # type: ignore[arg-type]

    def sent_to(self, worker_id: str) -> list[Command]:
        """The commands ``worker_id`` was sent (by name, or as one of those addressed)."""
        cohorts: set[tuple[int, str]] = set()
        sent = []
        for _, command in self.commands:
            if is_addressed_to(command, worker_id, cohorts):
                sent.append(command)
                if _phase(command) is Phase.PAUSE:
                    cohorts.add((command.epoch, command.update_id))
        return sent

    def phases_acked(self, worker_id: str) -> list[Phase]:
        return [ack.phase for ack in self.acks if ack.worker_id == worker_id]

    def lose(self, worker_id: str, phase: Phase, *, times: int = 1) -> None:
        """The next ``times`` commands of ``phase`` never reach ``worker_id``."""

        def rule(conn: str, subject: str, data: bytes) -> bool:
            if conn != worker_id or not subject.startswith(self.subjects.cmd()):
                return False
            return _phase_or_none(data) is phase

        self.server.drop(rule, times=times)

    def lose_acks(self, worker_id: str, phase: Phase, *, times: int = 1_000_000) -> None:
        """``worker_id``'s acks of ``phase`` never reach the coordinator."""

        def rule(conn: str, subject: str, data: bytes) -> bool:
            if conn != "coordinator" or subject != self.subjects.ack(worker_id):
                return False
            return ack_decoder.decode(data).phase is phase

        self.server.drop(rule, times=times)


class _DeadProcess:
    """The engine as a killed agent reaches it: not at all."""

    kind = "memory"

    def __getattr__(self, name: str) -> Any:
        async def unreachable(*args: Any, **kwargs: Any) -> None:
            raise asyncio.CancelledError  # the process is gone mid-call

        return unreachable


def _phase(command: Command) -> Phase | None:
    with contextlib.suppress(ValueError):
        return phase_of(command)  # type: ignore[arg-type]
    return None


def _phase_or_none(data: bytes) -> Phase | None:
    with contextlib.suppress(Exception):
        return _phase(command_decoder.decode(data))
    return None
