"""An agent ignores a fleet state record in KV that does not decode, and says
so: in every heartbeat while it lasts, and once in the trail. It keeps what
it knew meanwhile, and takes the record again once it decodes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from hand_coordinator import EPOCH, HandCoordinator, write_leader
from nats.aio.msg import Msg

from lorabus.agents import Agent, CommandExecutor
from lorabus.agents.dynamo import DynamoDriver
from lorabus.bus.connect import close, connect
from lorabus.schemas import (
    BadMessage,
    CommandRefused,
    CommittedNotice,
    CommittedRecord,
    Event,
    Heartbeat,
    PauseCommand,
    Reconciled,
    Subjects,
    build_rank_map,
    encode,
    heartbeat_decoder,
)
from lorabus.simfleet import SimFleet, SimWorker

DEADLINE_S = 10.0
WORKER = "w000"
GARBAGE = b'{"holder": 7, "epoch": "not a number"'


class _Beats:
    """The agent's heartbeats, as a coordinator hears them."""

    def __init__(self) -> None:
        self.beats: list[Heartbeat] = []
        self._arrived = asyncio.Event()

    async def on_beat(self, msg: Msg) -> None:
        self.beats.append(heartbeat_decoder.decode(msg.data))
        self._arrived.set()

    async def wait_for(self, condition: Callable[[Heartbeat], bool]) -> Heartbeat:
        async with asyncio.timeout(DEADLINE_S):
            while True:
                for beat in self.beats:
                    if condition(beat):
                        return beat
                self.beats.clear()
                self._arrived.clear()
                await self._arrived.wait()


class _Logged(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self._changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self._changed.set()

    async def wait_for(self, text: str) -> None:
        async with asyncio.timeout(DEADLINE_S):
            while not any(text in line for line in self.lines):
                self._changed.clear()
                await self._changed.wait()


async def _put(hand: HandCoordinator, key: str, value: bytes) -> None:
    kv = await hand.nc.jetstream().key_value(hand.subjects.state_bucket())
    await kv.put(key, value)


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    async with SimFleet([WORKER], [1]) as fleet:
        yield fleet


@pytest.fixture
async def beats(hand: HandCoordinator) -> _Beats:
    heard = _Beats()
    await hand.nc.subscribe(hand.subjects.heartbeat(WORKER), cb=heard.on_beat)
    await hand.nc.flush()
    return heard


@pytest.fixture
def logged() -> Iterator[_Logged]:
    handler = _Logged()
    logger = logging.getLogger("lorabus.agents.agent")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.setLevel(level)
    logger.removeHandler(handler)


@contextlib.asynccontextmanager
async def _running_agent(nats_url: str, fleet_name: str, sim: SimFleet) -> AsyncIterator[SimWorker]:
    driver = DynamoDriver(sim.system_url(WORKER))
    agent = Agent(Subjects(fleet=fleet_name), CommandExecutor(WORKER, 1, driver), heartbeat_s=0.2)
    nc = await connect(nats_url, name="test-agent")
    ready = asyncio.Event()
    serving = asyncio.create_task(agent.run(nc, ready))
    try:
        await asyncio.wait_for(ready.wait(), DEADLINE_S)
        yield sim.workers[WORKER]
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await close(nc)
        await driver.aclose()


async def _events_until_refused(hand: HandCoordinator, update_id: str) -> list[Event]:
    """The events heard up to the refusal of ``update_id`` (an agent's events
    arrive in the order it sent them)."""
    seen: list[Event] = []
    async with asyncio.timeout(DEADLINE_S):
        while True:
            event = await hand.events.get()
            seen.append(event)
            if isinstance(event, CommandRefused) and event.update_id == update_id:
                return seen


async def test_an_unreadable_leader_record_is_ignored_and_said_so_until_it_decodes(
    nats_url: str,
    fleet_name: str,
    sim: SimFleet,
    hand: HandCoordinator,
    beats: _Beats,
    logged: _Logged,
) -> None:
    await hand.lead(EPOCH)
    async with _running_agent(nats_url, fleet_name, sim) as engine:
        await _put(hand, "leader", GARBAGE)
        # A command of a later epoch makes the agent read the record again.
        events: list[Event] = []
        for n in (1, 2):
            ahead = PauseCommand(
                update_id=f"ahead-{n}", targets=[WORKER], budget_s=5, epoch=EPOCH + 1
            )
            await hand.nc.publish(hand.subjects.cmd_worker(WORKER), encode(ahead))
            events += await _events_until_refused(hand, f"ahead-{n}")
        said = await beats.wait_for(lambda b: b.unreadable_state != "")
        bad = [e for e in events if isinstance(e, BadMessage)]
        assert len(bad) == 1, "the same garbage read again is news to nobody"
        assert bad[0].source == f"agent:{WORKER}"
        assert bad[0].subject == f"$KV.{hand.subjects.state_bucket()}.leader"
        assert "leader record does not decode" in bad[0].error
        assert bad[0].size == len(GARBAGE)
        assert said.unreadable_state.startswith("leader: ")
        assert said.epoch_seen == EPOCH, "the epoch it knew stays"
        assert engine.count_requests("POST", "/engine/pause_generation") == 0

        # A coordinator writes the record again: the agent takes it and says so.
        await write_leader(hand.nc, hand.subjects, EPOCH + 1)
        healed = PauseCommand(update_id="healed", targets=[WORKER], budget_s=5, epoch=EPOCH + 1)
        await hand.nc.publish(hand.subjects.cmd_worker(WORKER), encode(healed))
        ack = await hand.next_ack("healed")
        assert ack.ok and ack.epoch == EPOCH + 1
        await beats.wait_for(lambda b: b.unreadable_state == "" and b.epoch_seen == EPOCH + 1)


async def test_an_agent_that_starts_on_an_unreadable_committed_record_takes_no_notice_until_one_decodes(  # noqa: E501
    nats_url: str,
    fleet_name: str,
    sim: SimFleet,
    hand: HandCoordinator,
    beats: _Beats,
    logged: _Logged,
    make_adapter: Callable[[int], str],
) -> None:
    await hand.lead(EPOCH)
    await _put(hand, "committed", GARBAGE)
    async with _running_agent(nats_url, fleet_name, sim) as engine:
        said = await beats.wait_for(lambda b: b.unreadable_state != "")
        assert said.unreadable_state.startswith("committed: ")
        assert said.ready, "nothing it could read is committed"
        event = await hand.next_event(BadMessage)
        assert isinstance(event, BadMessage)
        assert event.subject.endswith(".committed")

        # A notice (a replayed old one, for all the agent can tell) is not
        # taken: it does not know what is committed, so it reads again.
        old = CommittedNotice(
            update_id="old",
            budget_s=0,
            epoch=EPOCH,
            served_name="policy-v1",
            path=make_adapter(1),
            version=1,
        )
        await hand.nc.publish(hand.subjects.cmd(), encode(old))
        await logged.wait_for("update=old committed notice put off")
        assert engine.loads_received == 0

        # The record decodes again: the agent converges on it.
        record = CommittedRecord(
            adapter="policy",
            version=2,
            path=make_adapter(2),
            served_name="policy-v2",
            rank_map=build_rank_map({WORKER: 1}),
        )
        await _put(hand, "committed", encode(record))
        await hand.nc.publish(hand.subjects.cmd(), encode(old))  # says: read again
        reconciled = await hand.next_event(Reconciled)
        assert isinstance(reconciled, Reconciled)
        assert reconciled.served_name == "policy-v2" and reconciled.ok
        assert sorted(engine.adapters) == ["policy-v2"]
        cleared = await beats.wait_for(lambda b: "policy-v2" in b.adapters)
        assert cleared.ready and cleared.unreadable_state == ""
