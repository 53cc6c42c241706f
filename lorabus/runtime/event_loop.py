"""How the serving processes run: on uvloop where it is installed, with a
garbage collector tuned for a long-running service.

A coordinator handles every agent's acks and heartbeats, an agent its
commands and its engine's HTTP answers; in both, asyncio's own overhead (its
Python-level TLS layer, its callback scheduling) is a large share of the CPU.
uvloop implements both in C, which takes about a quarter off both
(docs/performance.md). ``LORABUS_EVENT_LOOP=asyncio`` keeps asyncio's loop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import Callable

__all__ = ["EVENT_LOOP_ENV", "running_loop_name", "serving_loop_factory", "settle_collector"]

log = logging.getLogger(__name__)

EVENT_LOOP_ENV = "LORABUS_EVENT_LOOP"
_CHOICES = ("uvloop", "asyncio")

_YOUNG_GENERATION_SIZE = 50_000
"""Container objects allocated (net) before the collector's youngest pass
runs, against CPython's 700: an update holds thousands of acks at once, and
at 700 each pass re-traversed the large young dicts and lists of the phase."""


def settle_collector() -> None:
    """Tune the cyclic garbage collector for a long-running service, once what
    lives as long as the process has been built.

    Frozen, those objects (a coordinator's imports are about 50,000) are
    left out of every later collection, which traversed them all on each
    full pass; the youngest generation is larger, so passes run less often.
    """
    gc.collect()  # garbage frozen would never be collected
    gc.freeze()
    gc.set_threshold(_YOUNG_GENERATION_SIZE, 10, 10)


def serving_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory, or None for asyncio's default loop: when
    ``LORABUS_EVENT_LOOP`` is ``asyncio`` or uvloop is not installed (it does
    not build on Windows)."""
    choice = os.environ.get(EVENT_LOOP_ENV, "uvloop").strip().lower() or "uvloop"
    if choice not in _CHOICES:
        raise ValueError(f"{EVENT_LOOP_ENV} must be one of {', '.join(_CHOICES)}, not {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        log.debug("uvloop is not installed: asyncio's event loop")
        return None
    return uvloop.new_event_loop


def running_loop_name() -> str:
    """``uvloop`` or ``asyncio``: the loop this coroutine runs on, for a ready line."""
    return (
        "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
    )
