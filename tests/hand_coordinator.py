"""A coordinator played by hand: a plain NATS client that sends commands and
collects acks and events, so an agent's rules are tested one at a time."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from lorabus.schemas import Ack, Event, Subjects, ack_decoder, encode, event_decoder

DEADLINE_S = 10.0
#: Above the epoch of an embedded stack's own coordinator, so its agents accept us.
EPOCH = 100


class HandCoordinator:
    def __init__(self, nc: NatsClient, subjects: Subjects) -> None:
        self.nc, self.subjects = nc, subjects
        self.acks: asyncio.Queue[Ack] = asyncio.Queue()
        self.events: asyncio.Queue[Event] = asyncio.Queue()

    async def start(self) -> None:
        async def on_ack(msg: Msg) -> None:
            self.acks.put_nowait(ack_decoder.decode(msg.data))

        async def on_event(msg: Msg) -> None:
            self.events.put_nowait(event_decoder.decode(msg.data))

        await self.nc.subscribe(self.subjects.ack_any(), cb=on_ack)
        await self.nc.subscribe(self.subjects.event_any(), cb=on_event)
        await self.nc.flush()

    async def send(self, command: object) -> None:
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
