"""Closing a connection while the nats-server is down neither raises nor hangs.

A service stopped during a bus outage must exit cleanly: nats-py flushes the
publishes it buffered while reconnecting into the dead connection on close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lorabus.bus.connect import close, connect
from lorabus.testbed.natsserver import NatsServer

DEADLINE_S = 10.0
POLL_S = 0.01


async def _poll(condition: Callable[[], bool]) -> None:
    """Until ``condition()`` holds (nats-py offers no event for it), within the deadline."""
    for _ in range(int(DEADLINE_S / POLL_S)):
        if condition():
            return
        await asyncio.sleep(POLL_S)
    raise AssertionError(f"not within {DEADLINE_S:.0f}s")


async def test_close_with_publishes_buffered_during_an_outage() -> None:
    server = NatsServer()
    await server.start()
    try:
        nc = await connect(server.url, name="test-close-while-down")
        server.stop()
        await _poll(lambda: nc.is_reconnecting)
        await nc.publish("lorabus.test.buffered", b"sent while the server is down")

        await asyncio.wait_for(close(nc), DEADLINE_S)
    finally:
        server.stop()

    assert nc.is_closed
