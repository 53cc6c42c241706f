"""A coordinator played by hand: a plain NATS client that sends commands and
collects acks and events, so an agent's rules are tested one at a time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from lorabus.agents import Agent, AgentConfig, driver_for
from lorabus.bus.connect import close, connect
from lorabus.schemas import (
    Ack,
    Event,
    LeaderRecord,
    Subjects,
    ack_decoder,
    encode,
    event_decoder,
)
from lorabus.simfleet import SimFleet, SimWorker

DEADLINE_S = 10.0
#: Above the epoch of an embedded stack's own coordinator, so its agents accept us.
EPOCH = 100


class HandCoordinator:
    def __init__(self, nc: NatsClient, subjects: Subjects) -> None:
        self.nc, self.subjects = nc, subjects
        self.acks: asyncio.Queue[Ack] = asyncio.Queue()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.epoch = 0
        """The epoch of the leader record this hand wrote (0: none yet)."""

    async def start(self) -> None:
        async def on_ack(msg: Msg) -> None:
            self.acks.put_nowait(ack_decoder.decode(msg.data))

        async def on_event(msg: Msg) -> None:
            self.events.put_nowait(event_decoder.decode(msg.data))

        await self.nc.subscribe(self.subjects.ack_any(), cb=on_ack)
        await self.nc.subscribe(self.subjects.event_any(), cb=on_event)
        await self.nc.flush()

    async def lead(self, epoch: int) -> None:
        await write_leader(self.nc, self.subjects, epoch)
        self.epoch = epoch

    async def send(self, command: object) -> None:
        """Publish ``command``; the first one claims the fleet's leader record at
        EPOCH (a running coordinator of the fleet steps down then)."""
        if not self.epoch:
            await self.lead(EPOCH)
        await self.nc.publish(self.subjects.cmd(), encode(command))  # type: ignore[arg-type]

    async def next_ack(self, update_id: str | None = None) -> Ack:
        """The next ack (of ``update_id``, when given: others are skipped)."""
        while True:
            ack = await asyncio.wait_for(self.acks.get(), DEADLINE_S)
            if update_id is None or ack.update_id == update_id:
                return ack

    async def next_event(self, kind: type) -> Event:
        while True:
            event = await asyncio.wait_for(self.events.get(), DEADLINE_S)
            if isinstance(event, kind):
                return event


@contextlib.asynccontextmanager
async def real_agent(
    nats_url: str, config: AgentConfig, sim: SimFleet, name: str
) -> AsyncIterator[SimWorker]:
    """A real agent of ``config`` on a connection of its own, driving its
    simulated engine in ``sim``; yields that engine once the agent is ready,
    its request log cleared of the resume an agent sends when it starts."""
    driver = driver_for(config)
    agent = Agent.from_config(config, driver)
    nc = await connect(nats_url, name=name)
    ready = asyncio.Event()
    serving = asyncio.create_task(agent.run(nc, ready))
    try:
        await asyncio.wait_for(ready.wait(), DEADLINE_S)
        engine = sim.workers[config.worker_id]
        engine.requests.clear()
        yield engine
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await close(nc)
        await driver.aclose()


async def write_leader(nc: NatsClient, subjects: Subjects, epoch: int) -> None:
    """Write the fleet's leader record: agents adopt an epoch only once it shows it.
    A coordinator of the fleet that is running steps down on seeing it."""
    js = nc.jetstream()
    try:
        kv = await js.key_value(subjects.state_bucket())
    except nats.js.errors.BucketNotFoundError:
        kv = await js.create_key_value(bucket=subjects.state_bucket())
    await kv.put("leader", encode(LeaderRecord(holder="hand", epoch=epoch)))
