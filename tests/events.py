"""A test's ear on a fleet's events, as the audit tap hears them (core NATS)."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from lorabus.schemas import Event, Subjects, event_decoder

DEADLINE_S = 15.0
_E = TypeVar("_E")


class EventListener:
    """Collects the fleet's events, as the audit tap sees them."""

    def __init__(self, nc: NatsClient, subjects: Subjects) -> None:
        self.nc, self.subjects = nc, subjects
        self.events: list[Event] = []
        self._arrived = asyncio.Event()

    async def start(self) -> None:
        async def on_event(msg: Msg) -> None:
            self.events.append(event_decoder.decode(msg.data))
            self._arrived.set()

        await self.nc.subscribe(self.subjects.event_any(), cb=on_event)
        await self.nc.flush()

    async def wait_for(self, kind: type[_E], count: int = 1) -> list[_E]:
        """The events of ``kind`` heard so far, once there are ``count``."""
        async with asyncio.timeout(DEADLINE_S):
            while len(found := [e for e in self.events if isinstance(e, kind)]) < count:
                self._arrived.clear()
                await self._arrived.wait()
        return found
