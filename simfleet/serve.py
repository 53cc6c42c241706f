"""Run a simulated fleet until cancelled: the entry point for the CLI.

``lorabus up`` / ``lorabus sim`` run this in a task and cancel it on Ctrl-C;
the fleet is stopped in ``finally`` whatever ends the wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .fleet import SimFleet

__all__ = ["serve_forever"]


async def serve_forever(
    fleet: SimFleet,
    host: str = "127.0.0.1",
    port: int = 0,
    ready: Callable[[SimFleet], None] | None = None,
) -> None:
    """Start ``fleet``, call ``ready(fleet)``, then serve until cancelled."""
    await fleet.start(host, port)
    try:
        if ready is not None:
            ready(fleet)
        await asyncio.get_running_loop().create_future()
    finally:
        await fleet.stop()
