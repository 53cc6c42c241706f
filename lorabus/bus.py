"""Connecting to NATS with settings that fail fast and notice dead links early.

nats-py's defaults suit long-lived services badly here: the first connect
retries for about two minutes on a wrong URL, and a dead link is noticed only
after two minutes of pings. Every lorabus process connects through this module.
"""

from __future__ import annotations

import asyncio
import logging

import nats
from nats.aio.client import Client as NatsClient

from lorabus.errors import BusUnreachable

log = logging.getLogger(__name__)


async def connect(url: str, *, name: str, connect_timeout_s: float = 10.0) -> NatsClient:
    nc = NatsClient()

    async def on_error(exc: Exception) -> None:
        # Before the first connection, failures are summed up by BusUnreachable.
        log.log(
            logging.WARNING if nc.is_connected or nc.is_reconnecting else logging.DEBUG,
            "nats (%s): %s",
            name,
            exc,
        )

    async def on_disconnect() -> None:
        if not (nc.is_closed or nc.is_draining):
            log.warning("nats (%s): disconnected, reconnecting", name)

    async def on_reconnect() -> None:
        log.info("nats (%s): reconnected", name)

    try:
        await asyncio.wait_for(
            nc.connect(
                # A comma-separated list names the nodes of a cluster.
                servers=[part.strip() for part in url.split(",") if part.strip()],
                name=name,
                connect_timeout=2,
                # nats-py annotates this as int, but waits a float of seconds.
                reconnect_time_wait=0.5,  # type: ignore[arg-type]
                max_reconnect_attempts=-1,
                ping_interval=5,
                max_outstanding_pings=3,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
            ),
            timeout=connect_timeout_s,
        )
    except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
        await nc.close()
        raise BusUnreachable(f"cannot reach NATS at {url} within {connect_timeout_s:.0f}s") from exc
    return nc


async def close(nc: NatsClient) -> None:
    """Drain (so queued publishes go out) with a deadline, then close."""
    try:
        await asyncio.wait_for(nc.drain(), timeout=5)
    except Exception as exc:
        log.debug("drain of %s failed (%s); closing", nc.connected_url, exc)
    if not nc.is_closed:
        try:
            await nc.close()
        except OSError as exc:
            # nats-py flushes publishes buffered during a reconnect into the
            # dead connection and raises: the connection is gone either way.
            log.debug("closing %s: %r", nc.connected_url, exc)
