"""Connecting to NATS with settings that fail fast and notice dead links early.

nats-py's defaults suit long-lived services badly here: the first connect
retries for about two minutes on a wrong URL, and a dead link is noticed only
after two minutes of pings. Every lorabus process connects through this module.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import nats
from nats.aio.client import Client as NatsClient

from lorabus.errors import BusUnreachable, PermissionDenied

log = logging.getLogger(__name__)

_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)?[^/@]*@")


async def connect(url: str, *, name: str, connect_timeout_s: float = 10.0) -> NatsClient:
    """A connection to ``url`` (a comma-separated list for a cluster's nodes).

    Raises :class:`PermissionDenied` as soon as the server refuses the
    credentials, and :class:`BusUnreachable` when no connection is made within
    ``connect_timeout_s``; neither message shows a password from the URL.
    """
    nc = NatsClient()
    servers = [part.strip() for part in url.split(",") if part.strip()]
    refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    refusals = 0

    async def on_error(exc: Exception) -> None:
        nonlocal refusals
        if not refused.done() and not nc.is_connected and is_auth_refusal(exc):
            # nats-py would retry the same credentials forever; in a cluster,
            # another node may still take them, so every node gets its turn.
            refusals += 1
            if refusals >= len(servers):
                refused.set_result(str(exc))
        # Before the first connection, failures are summed up by the errors raised below.
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

    connecting = asyncio.ensure_future(
        nc.connect(
            servers=servers,
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
        )
    )
    try:
        either: set[asyncio.Future[Any]] = {connecting, refused}
        await asyncio.wait(either, timeout=connect_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if refused.done() and not (connecting.done() and connecting.exception() is None):
            raise PermissionDenied(f"NATS at {redact(url)} refused to connect: {refused.result()}")
        if not connecting.done():
            raise BusUnreachable(
                f"cannot reach NATS at {redact(url)} within {connect_timeout_s:.0f}s"
            )
        try:
            connecting.result()
        except (OSError, nats.errors.Error) as exc:
            raise BusUnreachable(f"cannot reach NATS at {redact(url)}: {exc}") from exc
    except BaseException:
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)
        await nc.close()
        raise
    return nc


def is_auth_refusal(exc: BaseException) -> bool:
    """Whether NATS refused the credentials (a wrong password, an unknown user)."""
    text = str(exc).lower()
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in text


def redact(url: str) -> str:
    """``url`` (or a comma-separated list of them) without user names and passwords."""
    return ",".join(_redact_one(part.strip()) for part in url.split(","))


def _redact_one(url: str) -> str:
    return _USERINFO.sub(r"\1", url)


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
