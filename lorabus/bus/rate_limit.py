"""A per-second allowance, for reports that junk input could otherwise flood.

Every dropped message is logged and counted; only the first few a second also
become ``bad_message`` events, so a flood of junk on the bus cannot also fill
the audit stream.
"""

from __future__ import annotations

from collections.abc import Callable

from lorabus.runtime.clock import now


class PerSecond:
    def __init__(self, allowed: int, clock: Callable[[], float] = now) -> None:
        self.allowed = allowed
        self._clock = clock
        self._second = -1
        self._used = 0

    def take(self) -> bool:
        """Whether one more report fits in the current second."""
        second = int(self._clock())
        if second != self._second:
            self._second, self._used = second, 0
        if self._used >= self.allowed:
            return False
        self._used += 1
        return True
