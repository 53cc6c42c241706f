"""Quiet windows: stretches of a chaos run in which no tenant's loop asks for anything.

An engine left paused with nobody holding it shows only if no update pauses
and resumes it again within the pause lease and its grace: one trainer's
loop now and then waits longer than that between two steps. With several
trainers, the others would go on pausing every engine; so one loop (the
first tenant's) decides when the fleet goes quiet: it asks for a window,
the other loops finish the step they are in and start no other, and once
every step has ended the window lasts its length; then every loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class QuietWindows:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        """Set while no quiet window is asked for: steps may start."""
        self._open.set()
        self._stepping = 0
        self._idle = asyncio.Event()
        """Set while no loop is inside a step."""
        self._idle.set()
        self.held = 0
        """Quiet windows held so far."""

    @contextlib.asynccontextmanager
    async def step(self) -> AsyncIterator[None]:
        """Around one step of a loop: it waits for a quiet window to end first."""
        await self._open.wait()
        self._stepping += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._stepping -= 1
            if self._stepping == 0:
                self._idle.set()

    async def hold(self, seconds: float) -> None:
        """Keep every loop from starting a step until the steps under way have
        ended and ``seconds`` have passed since (called between two steps)."""
        self._open.clear()
        try:
            await self._idle.wait()
            self.held += 1
            # The quiet window itself: a time, not a condition.
            await asyncio.sleep(seconds)
        finally:
            self._open.set()
