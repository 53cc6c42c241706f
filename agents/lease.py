"""The pause lease: an engine paused by a coordinator that went silent resumes.

A pause arms the lease; renewals push its end out; a resume releases it. When
the end passes with none of these, the agent resumes its engine on its own, so
a coordinator that dies (or is cut off) mid-update cannot leave it paused.

    RELEASED --arm--> HELD --renew--> HELD --release--> RELEASED
                        └--end passes--> EXPIRED --(agent resumes)--> RELEASED
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable

from lorabus.cancellation import raise_if_cancelled
from lorabus.clock import now


class LeaseState(enum.Enum):
    RELEASED = "released"
    HELD = "held"
    EXPIRED = "expired"


class PauseLease:
    def __init__(self, clock: Callable[[], float] = now) -> None:
        self._clock = clock
        self.state = LeaseState.RELEASED
        self.update_id = ""
        self._ends_at = 0.0
        self._changed = asyncio.Event()

    def arm(self, update_id: str, lease_s: float) -> None:
        if lease_s <= 0:
            return
        self.state, self.update_id = LeaseState.HELD, update_id
        self._ends_at = self._clock() + lease_s
        self._changed.set()

    def renew(self, update_id: str, lease_s: float) -> None:
        if self.state is LeaseState.HELD and update_id == self.update_id:
            self._ends_at = max(self._ends_at, self._clock() + lease_s)
            self._changed.set()

    def release(self) -> None:
        self.state = LeaseState.RELEASED
        self._changed.set()

    @property
    def remaining_s(self) -> float | None:
        return self._ends_at - self._clock() if self.state is LeaseState.HELD else None

    async def watch(self, on_expiry: Callable[[str], Awaitable[None]]) -> None:
        """Run forever: call ``on_expiry(update_id)`` whenever a held lease runs out."""
        while True:
            raise_if_cancelled()
            self._changed.clear()
            remaining = self.remaining_s
            if remaining is None:
                await self._changed.wait()
                continue
            if remaining > 0:
                try:
                    async with asyncio.timeout(remaining):
                        await self._changed.wait()
                except TimeoutError:
                    pass
                continue
            self.state = LeaseState.EXPIRED
            await on_expiry(self.update_id)
