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
from collections.abc import Awaitable, Callable, Collection

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
    itself again; one that fires on a released lease does nothing.

    Several updates may hold one pause (a round of pause-mode updates of
    different adapters, which the coordinator names in each pause,
    ``shared_with``): each holds it under its own update id, renewed and
    released on its own, and the engine resumes once none holds it. A pause
    drops every holder it does not share with (a pause whose resume was
    lost), and a resume of a later term than a hold's does not wait for it
    (a new leader rolling back a dead one's round resumes the engine)."""

    def __init__(self) -> None:
        self.state = LeaseState.RELEASED
        self.update_id = ""
        """The update whose hold ran out last (or was armed last)."""
        self._holders: dict[str, float] = {}
        """Update id -> when its hold ends (monotonic)."""
        self._epochs: dict[str, int] = {}
        """Update id -> the term of its pause."""
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0
        self._ran_out = asyncio.Event()

    def arm(
        self, update_id: str, lease_s: float, shared_with: Collection[str] = (), epoch: int = 0
    ) -> None:
        if lease_s <= 0:
            return
        kept = set(shared_with) if self.state is LeaseState.HELD else set()
        self._holders = {u: end for u, end in self._holders.items() if u in kept}
        self._epochs = {u: e for u, e in self._epochs.items() if u in kept}
        self._holders[update_id] = now() + lease_s
        self._epochs[update_id] = epoch
        self.state, self.update_id = LeaseState.HELD, update_id
        ends_at = min(self._holders.values())
        if self._timer is not None and self._timer_at <= ends_at:
            return  # it fires first and sets itself for the new end
        if self._timer is not None:
            self._timer.cancel()
        self._set_timer(ends_at)

    def renew(self, update_id: str, lease_s: float) -> None:
        if self.state is LeaseState.HELD and update_id in self._holders:
            self._holders[update_id] = max(self._holders[update_id], now() + lease_s)

    def release(self, update_id: str | None = None) -> None:
        """Let ``update_id``'s hold go (None: every hold, the engine resumed)."""
        if update_id is not None:
            self._holders.pop(update_id, None)
            self._epochs.pop(update_id, None)
        else:
            self._holders.clear()
            self._epochs.clear()
        if not self._holders:
            self.state = LeaseState.RELEASED

    def held_by_others(self, update_id: str, epoch: int = 0) -> list[str]:
        """The other updates that hold the pause, of term ``epoch`` or later: a
        resume of ``update_id`` leaves the engine paused for them."""
        if self.state is not LeaseState.HELD:
            return []
        return sorted(
            u for u in self._holders if u != update_id and self._epochs.get(u, 0) >= epoch
        )

    @property
    def remaining_s(self) -> float | None:
        if self.state is not LeaseState.HELD:
            return None
        return max(self._holders.values()) - now()

    def _set_timer(self, at: float) -> None:
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.state is not LeaseState.HELD:
            return
        ended = [u for u, end in self._holders.items() if end - now() <= _EARLY_S]
        holding = {u: end for u, end in self._holders.items() if u not in ended}
        self._epochs = {u: e for u, e in self._epochs.items() if u in holding}
        if holding:  # renewed since the timer was set, or others hold the engine
            self._holders = holding
            self._set_timer(min(holding.values()))
            return
        self._holders = {}
        self.update_id = ended[-1]
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
