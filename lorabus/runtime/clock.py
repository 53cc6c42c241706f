"""The clock every lorabus deadline, lease and age is measured on: the event loop's.

In production a loop's clock is the system's monotonic clock (on uvloop, the
serving processes' loop, in whole milliseconds, read once per loop turn:
phase durations are reported to the millisecond). Measuring everything
on it rather than calling ``time.monotonic()`` directly keeps the deadlines
lorabus computes in step with ``asyncio.sleep`` and ``asyncio.timeout``, so a
test can run the whole of an update, a pause lease or a leader election on a
fake loop clock (looptime) in milliseconds, without a real sleep.
"""

from __future__ import annotations

import asyncio
import time


def now() -> float:
    """Seconds on the running loop's clock; outside a loop (the metrics HTTP
    thread), ``time.monotonic()``, which is what a loop's clock is in production."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
