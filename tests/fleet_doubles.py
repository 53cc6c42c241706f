"""Scripted agents, and two ways to connect them to a coordinator's update runner.

The lifecycle scenarios run the real :class:`UpdateRunner`, the real
:class:`Membership` and the real ack gathering against agents that follow a
script (fail the load, never ack a phase, lose the first copy of a command,
stop heartbeating), over either of two buses:

- :class:`MemoryFleet`: commands, acks and heartbeats are method calls in one
  process, so a test can also run on a fake loop clock (looptime) and take
  milliseconds whatever the timeouts;
- :class:`NatsFleet`: the coordinator's real :class:`CoordinatorBus` on a real
  nats-server, the agents subscribed on their real subjects.

Both give the scenario the same handles (``runner()``, ``agents``,
``last_inflight()``), as FastStream runs one suite on an in-memory broker and
on a real one. The engines and the frontend are in-process either way: what
varies is the bus. :class:`MemoryLeaderStore` is the leader record's store,
in memory, for the election's tests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from lorabus.coordinator.alerts import MemberAlerts
from lorabus.coordinator.bus import CoordinatorBus
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.gather import AckRouter
from lorabus.coordinator.lifecycle import UpdateRunner
from lorabus.coordinator.membership import Membership
from lorabus.coordinator.metrics import CoordinatorMetrics
from lorabus.coordinator.ports import CommandBus
from lorabus.coordinator.signals import LostRace, StoreUnavailable
from lorabus.coordinator.store import FleetStore
from lorabus.errors import FrontendUnverified
from lorabus.schemas import (
    Ack,
    Command,
    CommittedNotice,
    ErrorCode,
    ErrorInfo,
    Event,
    Heartbeat,
    InflightRecord,
    LeaderRecord,
    LoadCommand,
    PauseCommand,
    Phase,
    RenewLeaseCommand,
    ResumeCommand,
    Subjects,
    UnloadCommand,
    carried_load,
    command_decoder,
    encode,
    is_addressed_to,
    phase_of,
)

HEARTBEAT_S = 0.2


@dataclass
class Script:
    """How one scripted agent misbehaves; the default acks everything at once."""

    fail_load: bool = False
    fail_pause: bool = False
    """Its engine refuses to pause: the pause is acked failed, and the load it
    carries is refused ``not_paused``, as a real agent does."""
    silent: frozenset[Phase] = frozenset()
    """Phases it never acks (its heartbeats go on)."""
    lose_first: frozenset[Phase] = frozenset()
    """Phases whose first command it never receives, as core NATS may drop one."""
    dies_at: Phase | None = None
    """The phase whose command stops it: no ack, no heartbeat from then on."""


@dataclass
class ScriptedAgent:
    worker_id: str
    world_size: int
    script: Script = field(default_factory=Script)
    adapters: list[str] = field(default_factory=list)
    paused: bool = False
    alive: bool = True
    received: list[Command] = field(default_factory=list)
    """Every command addressed to it, in arrival order (re-sends included)."""
    cohorts: set[tuple[int, str]] = field(default_factory=set)
    paused_for: set[tuple[int, str]] = field(default_factory=set)
    """(epoch, update id) of every pause it carried out."""
    _lost: set[Phase] = field(default_factory=set)

    def addressed(self, command: Command) -> bool:
        return is_addressed_to(command, self.worker_id, self.cohorts)

    def handle(self, command: Command) -> list[Ack]:
        """Carry out a command addressed to this agent; the acks to send. A
        pause that carries its load runs it at once, as a real agent does, and
        acks both in one message when the pause held and asked for that."""
        acks = [ack] if (ack := self._handle_one(command)) is not None else []
        if (
            isinstance(command, PauseCommand)
            and command.then_load is not None
            and (acks or (command.epoch, command.update_id) in self.paused_for)
        ):
            load = self._handle_one(carried_load(command, command.then_load))
            if load is not None and acks and acks[0].ok and command.then_load.ack_hold_s > 0:
                # Its load ends at once: asked to, it acks the pause inside the
                # load's ack, as a real agent does (agents/agent.py).
                acks = [msgspec.structs.replace(load, with_pause=True, pause_s=acks[0].duration_s)]
            else:
                acks += [load] if load is not None else []
        return acks

    def _handle_one(self, command: Command) -> Ack | None:
        if not self.alive:
            return None
        if isinstance(command, PauseCommand):
            self.cohorts.add((command.epoch, command.update_id))
        if isinstance(command, RenewLeaseCommand | CommittedNotice):
            self.received.append(command)
            return None
        phase = phase_of(command)
        if (
            isinstance(command, LoadCommand)
            and command.after_pause
            and (command.epoch, command.update_id) not in self.paused_for
        ):
            self.received.append(command)
            return Ack(
                update_id=command.update_id,
                phase=phase,
                worker_id=self.worker_id,
                ok=False,
                world_size=self.world_size,
                adapters=list(self.adapters),
                paused=self.paused,
                error=ErrorInfo(code=ErrorCode.NOT_PAUSED, message="not paused by this update"),
                epoch=command.epoch,
            )
        if phase in self.script.lose_first and phase not in self._lost:
            self._lost.add(phase)
            return None
        self.received.append(command)
        if self.script.dies_at is phase:
            self.alive = False
            return None
        if phase in self.script.silent:
            return None
        error = self._apply(command)
        return Ack(
            update_id=command.update_id,
            phase=phase,
            worker_id=self.worker_id,
            ok=error is None,
            world_size=self.world_size,
            adapters=list(self.adapters),
            paused=self.paused,
            error=error,
            epoch=command.epoch,
        )

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            worker_id=self.worker_id,
            world_size=self.world_size,
            engine="scripted",
            adapters=list(self.adapters),
            paused=self.paused,
            interval_s=HEARTBEAT_S,
        )

    def phases_received(self) -> list[Phase]:
        return [
            phase_of(c)
            for c in self.received
            if not isinstance(c, RenewLeaseCommand | CommittedNotice)
        ]

    def _apply(self, command: Command) -> ErrorInfo | None:
        match command:
            case PauseCommand(update_id=name) if self.script.fail_pause:
                return ErrorInfo(code=ErrorCode.ENGINE_ERROR, message=f"cannot pause for {name}")
            case PauseCommand():
                self.paused = True
                self.paused_for.add((command.epoch, command.update_id))
            case ResumeCommand():
                self.paused = False
            case LoadCommand(served_name=name) if self.script.fail_load:
                return ErrorInfo(code=ErrorCode.ENGINE_ERROR, message=f"cannot load {name}")
            case LoadCommand(served_name=name) if name not in self.adapters:
                self.adapters.append(name)
            case UnloadCommand(names=names):
                self.adapters = [a for a in self.adapters if a not in names]
        return None


class ListingFrontend:
    """A frontend that lists what any agent holds, as Dynamo's union of workers does."""

    def __init__(self, agents: Mapping[str, ScriptedAgent]) -> None:
        self.agents = agents

    async def wait_listed(self, model: str, timeout_s: float) -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        while not any(model in agent.adapters for agent in self.agents.values()):
            if loop.time() - started >= timeout_s:
                raise FrontendUnverified(f"{model!r} not listed within {timeout_s:.1f}s")
            await asyncio.sleep(0.02)
        return loop.time() - started


class MemoryJournal:
    def __init__(self) -> None:
        self.records: list[InflightRecord] = []

    async def record(self, in_flight: InflightRecord) -> None:
        self.records.append(in_flight)


class _Fleet:
    """What both buses share: the agents, the membership, the frontend, the runner."""

    bus: CommandBus

    def __init__(self, world_sizes: Mapping[str, int], scripts: Mapping[str, Script]) -> None:
        self.agents = {
            wid: ScriptedAgent(wid, size, scripts.get(wid, Script()))
            for wid, size in world_sizes.items()
        }
        self.membership = Membership()
        self.frontend = ListingFrontend(self.agents)
        self.fleet_name = "lifecycle"
        self._tasks: set[asyncio.Task[None]] = set()

    def config(self, **settings: Any) -> CoordinatorConfig:
        """The coordinator's config for this fleet; ``settings`` override its fields."""
        settings.setdefault("expected_world_size", sum(a.world_size for a in self.agents.values()))
        return CoordinatorConfig(
            fleet=self.fleet_name, frontend_url="http://frontend.invalid", **settings
        )

    def runner(self, **settings: Any) -> UpdateRunner:
        """An update runner of epoch 1 over this fleet; ``settings`` go to the config."""
        return UpdateRunner(
            self.config(**settings),
            self.membership,
            self.frontend,
            self.bus,
            self.journal(),
            CoordinatorMetrics(self.membership, MemberAlerts()),
            epoch=1,
        )

    def journal(self) -> Any:
        raise NotImplementedError

    async def last_inflight(self) -> InflightRecord | None:
        raise NotImplementedError

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _beat_forever(self) -> None:
        while True:
            for agent in self.agents.values():
                if agent.alive:
                    await self._beat(agent)
            await asyncio.sleep(HEARTBEAT_S)

    async def _beat(self, agent: ScriptedAgent) -> None:
        raise NotImplementedError

    async def _stop_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class MemoryFleet(_Fleet):
    """Scripted agents on an in-memory bus: publishing is a method call."""

    def __init__(self, world_sizes: Mapping[str, int], scripts: Mapping[str, Script]) -> None:
        super().__init__(world_sizes, scripts)
        self.bus = _MemoryBus(self)
        self._journal = MemoryJournal()
        self.events = self.bus.events

    def journal(self) -> MemoryJournal:
        return self._journal

    async def last_inflight(self) -> InflightRecord | None:
        return self._journal.records[-1] if self._journal.records else None

    async def __aenter__(self) -> MemoryFleet:
        for agent in self.agents.values():
            await self._beat(agent)
        self._spawn(self._beat_forever())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop_tasks()

    async def _beat(self, agent: ScriptedAgent) -> None:
        self.membership.observe(agent.heartbeat())

    def deliver(self, command: Command, to: list[ScriptedAgent]) -> None:
        for agent in to:
            if agent.addressed(command):
                self._spawn(self._respond(agent, command))

    async def _respond(self, agent: ScriptedAgent, command: Command) -> None:
        await asyncio.sleep(0)  # a publish returns before anyone has read it
        for ack in agent.handle(command):
            self.bus.acks.route(ack)
            self.membership.observe_ack(ack)


class _MemoryBus:
    """The :class:`CommandBus` of a :class:`MemoryFleet`."""

    def __init__(self, fleet: MemoryFleet) -> None:
        self.fleet = fleet
        self.acks = AckRouter()
        self.events: list[Event] = []

    async def broadcast(self, command: Command) -> None:
        self.fleet.deliver(command, list(self.fleet.agents.values()))

    async def send_to(self, worker_id: str, command: Command) -> None:
        agent = self.fleet.agents.get(worker_id)
        self.fleet.deliver(command, [agent] if agent is not None else [])

    async def emit(self, event: Event) -> None:
        self.events.append(event)


class NatsFleet(_Fleet):
    """Scripted agents subscribed on their real subjects of a real nats-server; the
    runner publishes through the coordinator's own :class:`CoordinatorBus`."""

    def __init__(
        self,
        world_sizes: Mapping[str, int],
        scripts: Mapping[str, Script],
        *,
        coordinator_nc: NatsClient,
        agents_nc: NatsClient,
        fleet: str,
    ) -> None:
        super().__init__(world_sizes, scripts)
        self.fleet_name = fleet
        self.subjects = Subjects(fleet=fleet)
        self.coordinator_bus = CoordinatorBus(coordinator_nc, self.subjects, self.membership)
        self.bus = self.coordinator_bus
        self._agents_nc = agents_nc
        self._store: FleetStore | None = None
        self._subs: list[Subscription] = []

    def journal(self) -> FleetStore:
        assert self._store is not None, "the fleet is started"
        return self._store

    async def last_inflight(self) -> InflightRecord | None:
        return await self.journal().read_inflight()

    async def __aenter__(self) -> NatsFleet:
        self._store = await FleetStore.open(self.coordinator_bus.nc, self.config())
        self._subs = await self.coordinator_bus.follow()
        for agent in self.agents.values():
            for subject in (self.subjects.cmd(), self.subjects.cmd_worker(agent.worker_id)):
                callback = self._on_command_for(agent)
                self._subs.append(await self._agents_nc.subscribe(subject, cb=callback))
        await self._agents_nc.flush(timeout=5)
        await self.coordinator_bus.nc.flush(timeout=5)
        for agent in self.agents.values():
            await self._beat(agent)
        await self._wait_members()
        self._spawn(self._beat_forever())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop_tasks()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _beat(self, agent: ScriptedAgent) -> None:
        subject = self.subjects.heartbeat(agent.worker_id)
        await self._agents_nc.publish(subject, encode(agent.heartbeat()))

    async def _wait_members(self) -> None:
        expected = sum(agent.world_size for agent in self.agents.values())
        await self.membership.wait_quorum(expected, timeout_s=10)

    def _on_command_for(self, agent: ScriptedAgent) -> Any:
        async def on_command(msg: Msg) -> None:
            command = command_decoder.decode(msg.data)
            if not agent.addressed(command):
                return
            for ack in agent.handle(command):
                await self._agents_nc.publish(self.subjects.ack(agent.worker_id), encode(ack))

        return on_command


class MemoryLeaderStore:
    """The leader record with compare-and-set, in memory; ``reachable`` False makes
    every call fail as an unreachable KV store does."""

    def __init__(self) -> None:
        self.record: LeaderRecord | None = None
        self.revision = 0
        self.reachable = True

    async def read_leader(self) -> tuple[LeaderRecord | None, int]:
        self._check_reachable()
        return self.record, self.revision

    async def write_leader(self, record: LeaderRecord, last_revision: int) -> int:
        self._check_reachable()
        if last_revision != self.revision:
            raise LostRace(f"revision {self.revision}, not {last_revision}")
        self.record, self.revision = record, self.revision + 1
        return self.revision

    def _check_reachable(self) -> None:
        if not self.reachable:
            raise StoreUnavailable("the KV store does not answer")
