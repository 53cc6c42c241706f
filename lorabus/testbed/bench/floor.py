"""The bus floor: a bare nats-py round, one publish to N and N acks back.

The limit of any control plane on this bus and this machine: the same
fan-out as a lorabus phase (one publish that NATS copies to every worker's
subscription, laid out in agent hosts like the agents) and the same gather (a
callback that counts acks and completes a future once all are in), with
nothing else: no decoding, no engine, no bookkeeping. One "update" of the
floor is three rounds, one per phase that lorabus runs inside the pause.
"""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from lorabus.schemas import Subjects

PHASES = 3


class RoundLost(Exception):
    """Raised when not every ack of a round arrives before its deadline."""


class FloorGather:
    """Publishes rounds on ``subjects.cmd()`` and counts echoes on ``ack.*``."""

    def __init__(self, nc: NatsClient, subjects: Subjects, members: int) -> None:
        self.nc = nc
        self.subjects = subjects
        self.members = members
        self._round = b""
        self._count = 0
        self._done: asyncio.Future[None] | None = None
        self._rounds = 0

    async def start(self) -> None:
        await self.nc.subscribe(self.subjects.ack_any(), cb=self._on_ack)
        await self.nc.flush(timeout=10)

    async def _on_ack(self, msg: Msg) -> None:
        if msg.data != self._round or self._done is None:
            return  # a late echo of an earlier round
        self._count += 1
        if self._count == self.members and not self._done.done():
            self._done.set_result(None)

    async def round(self, timeout_s: float = 10.0) -> float:
        """One publish, every ack gathered: the seconds it took."""
        self._rounds += 1
        self._round = b"round-%d" % self._rounds
        self._count = 0
        self._done = asyncio.get_running_loop().create_future()
        started = time.perf_counter()
        await self.nc.publish(self.subjects.cmd(), self._round)
        try:
            await asyncio.wait_for(self._done, timeout_s)
        except TimeoutError:
            raise RoundLost(
                f"{self._count} of {self.members} acks within {timeout_s:.0f}s"
            ) from None
        return time.perf_counter() - started

    async def update(self) -> list[float]:
        """The rounds of one update's worth of phases."""
        return [await self.round() for _ in range(PHASES)]
