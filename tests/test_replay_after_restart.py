"""A command is obeyed once, and only while it is current, across restarts:
every kind of signed command captured off the wire and replayed after the
agents (and the coordinator) restarted changes nothing, and the fleet still
commits the next real update."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from lorabus.agents import Agent, AgentConfig, driver_for
from lorabus.bus.connect import close, connect
from lorabus.coordinator import Coordinator
from lorabus.schemas import (
    Ack,
    CommittedNotice,
    LeaderElected,
    LoadCommand,
    PauseCommand,
    RefuseInstance,
    RenewLeaseCommand,
    ResumeCommand,
    Subjects,
    UnloadCommand,
    UpdateMode,
    ack_decoder,
    command_decoder,
    encode,
    event_decoder,
)
from lorabus.security.signing import CommandSigner, new_signing_seed
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 20.0
WORKERS = ("w000", "w001")
BEAT_S = 0.5
"""An agent counts as gone after three beats missed: at 0.2 s, a loaded machine
stalled the worker id's holder long enough for the duplicate to take it."""


class _Heard(logging.Handler):
    """The agents' log lines: a refusal is logged every time (its event is
    rate-limited), so the test knows when the agents have read every replay."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self._changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self._changed.set()

    async def wait_for(self, *texts: str) -> None:
        async with asyncio.timeout(DEADLINE_S):
            while not all(any(t in line for line in self.lines) for t in texts):
                self._changed.clear()
                await self._changed.wait()


class _AgentProcess:
    """One agent process of the fleet: its own connection and instance."""

    def __init__(self, stack: EmbeddedStack, worker_id: str, key: str) -> None:
        assert stack.sim is not None
        self.config = AgentConfig(
            fleet=stack.fleet_name,
            worker_id=worker_id,
            system_url=stack.sim.system_url(worker_id),
            frontend_url=stack.sim.url,
            world_size=1,
            heartbeat_s=BEAT_S,
            coordinator_keys=[key],
        )
        self.stack = stack
        self.agent: Agent | None = None
        self.nc: NatsClient | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        driver = driver_for(self.config)
        self.agent = Agent.from_config(self.config, driver)
        self.nc = await connect(self.stack.nats_url, name=f"test-{self.config.worker_id}")
        ready = asyncio.Event()
        self._task = asyncio.create_task(self.agent.run(self.nc, ready))
        self._driver = driver
        await asyncio.wait_for(ready.wait(), DEADLINE_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.nc is not None:
            await close(self.nc)
            await self._driver.aclose()
        self._task = self.nc = None


async def _stop_task(name: str) -> None:
    """Stop the stack's own task ``name`` (as its process would end)."""
    (task,) = [t for t in asyncio.all_tasks() if t.get_name() == name]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class _Fleet:
    """An embedded stack whose coordinator signs, with agents that check."""

    def __init__(self, stack: EmbeddedStack, key: str) -> None:
        self.stack, self.key = stack, key
        self.agents: dict[str, _AgentProcess] = {}
        self.coordinator: Coordinator | None = stack.coordinator
        self._extra: list[tuple[asyncio.Task[None], NatsClient]] = []

    async def restart_agent(self, worker_id: str) -> None:
        if worker_id in self.agents:
            await self.agents[worker_id].stop()
        else:
            await _stop_task(f"agent-{worker_id}")
        self.agents[worker_id] = _AgentProcess(self.stack, worker_id, self.key)
        await self.agents[worker_id].start()

    async def restart_coordinator(self, events: list[object], arrived: asyncio.Event) -> int:
        """A new coordinator process; returns its epoch once it leads."""
        assert self.coordinator is not None
        old_epoch = self.coordinator.epoch
        if self._extra:
            task, nc = self._extra.pop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await close(nc)
        else:
            await _stop_task("coordinator")
        config = msgspec.structs.replace(self.coordinator.config, holder="restarted")
        self.coordinator = Coordinator(config)
        nc = await connect(self.stack.nats_url, name="test-coordinator-restarted")
        self._extra.append((asyncio.create_task(self.coordinator.run(nc)), nc))
        async with asyncio.timeout(DEADLINE_S):
            while not any(isinstance(e, LeaderElected) and e.epoch > old_epoch for e in events):
                arrived.clear()
                await arrived.wait()
        return self.coordinator.epoch

    async def wait_members_known(self, subjects: Subjects) -> None:
        """Until the leader holds each worker id for its agent process of now
        (a restarted agent waits as a contender until its predecessor has
        missed three beats): a real update then names the right process.
        Looked at again on every heartbeat."""
        assert self.coordinator is not None
        membership = self.coordinator.membership
        beat = asyncio.Event()

        async def on_beat(msg: Msg) -> None:
            beat.set()

        nc = await connect(self.stack.nats_url, name="test-heartbeats")
        try:
            await nc.subscribe(subjects.heartbeat_any(), cb=on_beat)
            async with asyncio.timeout(DEADLINE_S):
                while any(
                    membership.instance_of(w) != p.agent.instance
                    for w, p in self.agents.items()
                    if p.agent is not None
                ):
                    beat.clear()
                    await beat.wait()
        finally:
            await close(nc)

    async def aclose(self) -> None:
        for process in self.agents.values():
            await process.stop()
        for task, nc in self._extra:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await close(nc)


@pytest.fixture
async def fleet(tmp_path: Path, nats_url: str, fleet_name: str) -> AsyncIterator[_Fleet]:
    seed = tmp_path / "signing.nk"
    seed.write_bytes(new_signing_seed())
    key = CommandSigner.from_file(seed).public_key
    async with EmbeddedStack(
        [1, 1],
        fleet=fleet_name,
        nats_url=nats_url,
        heartbeat_s=BEAT_S,
        signing_key_file=str(seed),
        phase_timeout_s=4.0,
        pause_lease_s=3.0,
        leader_lease_s=1.0,
        keep=1,
    ) as stack:
        fleet = _Fleet(stack, key)
        try:
            # The stack's agents check no signature: the fleet's own ones do.
            for worker_id in WORKERS:
                await fleet.restart_agent(worker_id)
            yield fleet
        finally:
            await fleet.aclose()


async def _capture_every_command(
    fleet: _Fleet, make_adapter: Callable[[int], str], subjects: Subjects
) -> list[Msg]:
    """Run updates that send every kind of command, and capture them all, as
    sent (headers and all)."""
    stack = fleet.stack
    assert stack.client is not None and stack.sim is not None
    captured: list[Msg] = []
    changed = asyncio.Event()

    async def capture(msg: Msg) -> None:
        captured.append(msg)
        changed.set()

    eavesdropper = await connect(stack.nats_url, name="test-eavesdropper")
    try:
        await eavesdropper.subscribe(subjects.cmd(), cb=capture)
        await eavesdropper.subscribe(f"{subjects.cmd()}.*", cb=capture)
        await eavesdropper.flush()
        # A second agent process claims w000: the leader refuses it by name.
        # Only the refusal is wanted here (that the refused process exits is
        # test_trust_identity's), so the test stops it once it is sent. It
        # starts once the leader holds w000 for the fleet's own agent: while
        # that one is still a contender to the stack's agent it replaced, the
        # duplicate could take the place and have the fleet's own refused.
        await fleet.wait_members_known(subjects)
        duplicate = _AgentProcess(stack, "w000", fleet.key)
        with contextlib.suppress(Exception):
            await duplicate.start()
        assert duplicate.agent is not None
        refused = duplicate.agent.instance

        def refusal_sent() -> bool:
            decoded = (command_decoder.decode(m.data) for m in captured)
            return any(isinstance(c, RefuseInstance) and c.instance == refused for c in decoded)

        async with asyncio.timeout(DEADLINE_S):
            while not refusal_sent():
                changed.clear()
                await changed.wait()
        await duplicate.stop()
        # A slow load and resume on w000: the load is sent again by name (after
        # its pause), so is the resume, and the pause lease is renewed.
        w000, w001 = stack.sim.workers["w000"], stack.sim.workers["w001"]
        w000.set_faults(latency_s={"load": 1.5, "resume": 1.5})
        first = await stack.client.update("policy", make_adapter(1), version=1)
        assert first.committed, first.error
        w000.set_faults(latency_s={})
        # A term's later pause is one broadcast.
        second = await stack.client.update("policy", make_adapter(2), version=2)
        assert second.committed, second.error
        # Live mode: a load by name, with no pause.
        live = await stack.client.update("policy", make_adapter(3), version=3, mode=UpdateMode.LIVE)
        assert live.committed, live.error
        # A failed update: its version is unloaded, by name, where it loaded.
        w001.set_faults(fail_next_loads=1, load_failure_status=400)
        failed = await stack.client.update("policy", make_adapter(4), version=4)
        assert not failed.committed

        def kinds() -> set[tuple[type, bool]]:
            decoded = [(m, command_decoder.decode(m.data)) for m in captured]
            return {(type(c), m.subject == subjects.cmd()) for m, c in decoded}

        wanted = {
            (PauseCommand, False),  # by name, carrying the load
            (PauseCommand, True),  # a broadcast, carrying the load
            (LoadCommand, False),  # a carried load sent again, and a live one
            (ResumeCommand, True),
            (ResumeCommand, False),  # sent again to a straggler
            (UnloadCommand, False),
            (RenewLeaseCommand, True),
            (CommittedNotice, True),
            (RefuseInstance, False),
        }
        async with asyncio.timeout(DEADLINE_S):
            while not wanted <= kinds():
                changed.clear()
                await changed.wait()
    finally:
        await close(eavesdropper)
    return list(captured)


def _posts(stack: EmbeddedStack) -> dict[str, list[str]]:
    assert stack.sim is not None
    return {
        w: [r.path for r in worker.requests if r.method != "GET"]
        for w, worker in stack.sim.workers.items()
    }


async def _replay_and_check(
    fleet: _Fleet, captured: list[Msg], subjects: Subjects, epoch: int
) -> list[str]:
    """Replay ``captured`` as it was sent; return what the agents logged."""
    stack = fleet.stack
    assert stack.sim is not None
    heard = _Heard()
    agent_log = logging.getLogger("lorabus.agents.agent")
    agent_log.addHandler(heard)
    acks: list[Ack] = []
    peer = await connect(stack.nats_url, name="test-replayer")

    async def on_ack(msg: Msg) -> None:
        acks.append(ack_decoder.decode(msg.data))

    adapters = {w: sorted(worker.adapters) for w, worker in stack.sim.workers.items()}
    try:
        await peer.subscribe(subjects.ack_any(), cb=on_ack)
        await peer.flush()
        for worker in stack.sim.workers.values():
            worker.requests.clear()
        for msg in captured:
            await peer.publish(msg.subject, msg.data, headers=msg.headers)
        # Unsigned markers, after the replays on each subject an agent reads:
        # once each is refused, every replay before it was read.
        for worker_id in WORKERS:
            marker = PauseCommand(
                update_id=f"marker-{worker_id}", targets=[worker_id], budget_s=5, epoch=epoch
            )
            await peer.publish(subjects.cmd_worker(worker_id), encode(marker))
        notice = CommittedNotice(
            update_id="marker-fleet", budget_s=0, epoch=epoch, served_name="x", path="/x", version=0
        )
        await peer.publish(subjects.cmd(), encode(notice))
        await peer.flush()
        await heard.wait_for(
            *(f"worker={w} update=marker-{w} refused" for w in WORKERS),
            *(f"worker={w} update=marker-fleet refused" for w in WORKERS),
        )
        for process in fleet.agents.values():
            assert process.nc is not None
            await process.nc.flush()
        await peer.flush()
    finally:
        agent_log.removeHandler(heard)
        await close(peer)

    assert _posts(stack) == {w: [] for w in WORKERS}, "an engine was driven by a replay"
    assert not any(worker.paused for worker in stack.sim.workers.values())
    assert {w: sorted(worker.adapters) for w, worker in stack.sim.workers.items()} == adapters
    assert acks == [], "a replay was acked"
    return heard.lines


def _command_types(captured: list[Msg]) -> set[str]:
    return {type(command_decoder.decode(m.data)).__name__ for m in captured}


async def test_every_captured_command_replayed_after_an_agent_restarted_changes_nothing(
    fleet: _Fleet, fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    subjects = Subjects(fleet=fleet_name)
    stack = fleet.stack
    assert stack.client is not None and stack.sim is not None and fleet.coordinator
    captured = await _capture_every_command(fleet, make_adapter, subjects)
    assert _command_types(captured) == {
        "PauseCommand",
        "LoadCommand",
        "ResumeCommand",
        "UnloadCommand",
        "CanaryCommand",
        "RenewLeaseCommand",
        "CommittedNotice",
        "RefuseInstance",
    }
    await fleet.restart_agent("w000")  # w001 runs on: it has seen them all

    lines = await _replay_and_check(fleet, captured, subjects, fleet.coordinator.epoch)

    refused_by_name = [line for line in lines if "not to this agent process" in line]
    assert any("worker=w000" in line and "refused pause" in line for line in refused_by_name)
    await fleet.wait_members_known(subjects)
    after = await stack.client.update("policy", make_adapter(5), version=5)
    assert after.committed, after.error
    assert _posts(stack)["w000"].count("/engine/pause_generation") == 1
    assert all("policy-v5" in worker.adapters for worker in stack.sim.workers.values())


async def test_every_captured_command_replayed_after_the_whole_fleet_restarted_changes_nothing(
    fleet: _Fleet, fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    subjects = Subjects(fleet=fleet_name)
    stack = fleet.stack
    assert stack.client is not None and stack.sim is not None
    captured = await _capture_every_command(fleet, make_adapter, subjects)
    events: list[object] = []
    arrived = asyncio.Event()
    listener = await connect(stack.nats_url, name="test-events")

    async def on_event(msg: Msg) -> None:
        events.append(event_decoder.decode(msg.data))
        arrived.set()

    try:
        await listener.subscribe(subjects.event_any(), cb=on_event)
        await listener.flush()
        epoch = await fleet.restart_coordinator(events, arrived)
        for worker_id in WORKERS:
            await fleet.restart_agent(worker_id)
        await _replay_and_check(fleet, captured, subjects, epoch)
    finally:
        await close(listener)

    await fleet.wait_members_known(subjects)
    after = await stack.client.update("policy", make_adapter(5), version=5)
    assert after.committed, after.error
    assert all(posts.count("/engine/pause_generation") == 1 for posts in _posts(stack).values())
    assert all("policy-v5" in worker.adapters for worker in stack.sim.workers.values())
