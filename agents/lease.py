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

from lorabus.runtime.cancellation import raise_if_cancelled
from lorabus.runtime.clock import now


class LeaseState(enum.Enum):
    RELEASED = "released"
    HELD = "held"
    EXPIRED = "expired"


_EARLY_S = 0.001
"""A timer may fire this much before the lease's end (the loop's clock
resolution); the lease then counts as run out instead of being re-timed."""


class PauseLease:
    """One loop timer, not a task that wakes on every change: a pause arms it
    and a resume releases the lease, once per update on every agent, and
    neither has to wake anything. A timer that fires on a renewed lease sets
    itself again; one that fires on a released lease does nothing."""

    def __init__(self) -> None:
        self.state = LeaseState.RELEASED
        self.update_id = ""
        self._ends_at = 0.0
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0
        self._ran_out = asyncio.Event()

    def arm(self, update_id: str, lease_s: float) -> None:
        if lease_s <= 0:
            return
        self.state, self.update_id = LeaseState.HELD, update_id
        self._ends_at = now() + lease_s
        if self._timer is not None and self._timer_at <= self._ends_at:
            return  # it fires first and sets itself for the new end
        if self._timer is not None:
            self._timer.cancel()
        self._set_timer()

    def renew(self, update_id: str, lease_s: float) -> None:
        if self.state is LeaseState.HELD and update_id == self.update_id:
            self._ends_at = max(self._ends_at, now() + lease_s)

    def release(self) -> None:
        self.state = LeaseState.RELEASED

    @property
    def remaining_s(self) -> float | None:
        return self._ends_at - now() if self.state is LeaseState.HELD else None

    def _set_timer(self) -> None:
        self._timer_at = self._ends_at
        self._timer = asyncio.get_running_loop().call_at(self._ends_at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.state is not LeaseState.HELD:
            return
        if self._ends_at - now() > _EARLY_S:  # renewed since the timer was set
            self._set_timer()
            return
        self.state = LeaseState.EXPIRED
        self._ran_out.set()

    async def watch(self, on_expiry: Callable[[str], Awaitable[None]]) -> None:
        """Run forever: call ``on_expiry(update_id)`` whenever a held lease runs out."""
        try:
            while True:
                raise_if_cancelled()
                await self._ran_out.wait()
                self._ran_out.clear()
                if self.state is LeaseState.EXPIRED:
                    await on_expiry(self.update_id)
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
