"""Connecting to NATS with settings that fail fast and notice dead links early.

nats-py's defaults suit long-lived services badly here: the first connect
retries for about two minutes on a wrong URL, and a dead link is noticed only
after two minutes of pings. Every lorabus process connects through this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
from typing import Any

import msgspec
import nats
import nats.js
from nats.aio.client import Client as NatsClient

from lorabus.bus_options import BusOptions
from lorabus.errors import BadRequest, BusError, BusUnreachable, PermissionDenied

log = logging.getLogger(__name__)


class _TlsCloseNoise(logging.Filter):
    """nats-py's protocol answers the end of a TLS stream the way plain TCP
    wants; asyncio then warns at every close of a TLS connection, to no use."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("returning true from eof_received()")


logging.getLogger("asyncio").addFilter(_TlsCloseNoise())

_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)?[^/@]*@")


class FleetConnection(NatsClient):
    """A NATS connection whose JetStream calls go where its identity's account
    has the fleet's JetStream (``BusOptions.js_api_prefix``): every part that
    reads a bucket or the audit stream gets it from the connection it is
    handed, and need not know which role it runs as."""

    def __init__(self, js_api_prefix: str | None = None) -> None:
        super().__init__()
        self.js_api_prefix = js_api_prefix

    def jetstream(self, **options: Any) -> nats.js.JetStreamContext:
        if self.js_api_prefix and "prefix" not in options and "domain" not in options:
            options["prefix"] = self.js_api_prefix
        return super().jetstream(**options)


def js_api_of(nc: NatsClient) -> str:
    """The JetStream API prefix of ``nc`` (for calls nats-py has no method for)."""
    return getattr(nc, "js_api_prefix", None) or "$JS.API"


class Bus(msgspec.Struct, frozen=True):
    """Where NATS is and who connects: a URL (or a cluster's) and an identity."""

    url: str
    options: BusOptions = BusOptions()

    async def connect(self, name: str, *, connect_timeout_s: float = 10.0) -> NatsClient:
        return await connect(
            self.url, name=name, options=self.options, connect_timeout_s=connect_timeout_s
        )


async def connect(
    url: str,
    *,
    name: str,
    options: BusOptions | None = None,
    connect_timeout_s: float = 10.0,
) -> NatsClient:
    """A connection to ``url`` (a comma-separated list for a cluster's nodes) as
    the identity ``options`` give (none: an unauthenticated one).

    Raises :class:`InsecureConnection` before sending anything the link would
    expose, :class:`PermissionDenied` as soon as the server refuses the
    credentials, and :class:`BusUnreachable` when no connection is made within
    ``connect_timeout_s``; no message shows a secret.
    """
    servers = [part.strip() for part in url.split(",") if part.strip()]
    options = options or BusOptions()
    try:
        identity = options.nats_kwargs(servers)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    nc = FleetConnection(options.js_api_prefix)
    refused: asyncio.Future[BusError] = asyncio.get_running_loop().create_future()
    refusals = 0

    async def on_error(exc: Exception) -> None:
        nonlocal refusals
        final = None if nc.is_connected else _refusal(exc, redact(url))
        if final is not None and not refused.done():
            # nats-py would retry the same credentials forever; in a cluster,
            # another node may still take them, so every node gets its turn.
            refusals += 1
            if refusals >= len(servers):
                refused.set_result(final)
        if is_permission_violation(exc):
            # Refused by this identity's permissions: a set-up to fix, said by name.
            log.error("nats (%s): %s", name, str(exc).removeprefix("nats: ").strip("'"))
            return
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
            **identity,
        )
    )
    try:
        either: set[asyncio.Future[Any]] = {connecting, refused}
        await asyncio.wait(either, timeout=connect_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if refused.done() and not (connecting.done() and connecting.exception() is None):
            raise refused.result()
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
        # A client that never connected cannot close cleanly (nats-py asserts).
        with contextlib.suppress(Exception):
            await nc.close()
        raise
    return nc


def _refusal(exc: BaseException, where: str) -> BusError | None:
    """The error to raise at once for a first-connect failure that trying again
    cannot mend (refused credentials, a TLS certificate either side refused);
    None for the others (a server not up yet, a network hiccup)."""
    if is_auth_refusal(exc):
        return PermissionDenied(
            f"authorization violation: NATS at {where} refused the credentials ({exc})"
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        return BusUnreachable(
            f"TLS: cannot verify the certificate of NATS at {where} ({exc.verify_message}); "
            "give its CA with --tls-ca"
        )
    if isinstance(exc, ssl.SSLError):
        return PermissionDenied(
            f"TLS: NATS at {where} refused this client ({exc.reason or exc}); it needs a "
            "client certificate from the server's CA (--tls-cert, --tls-key)"
        )
    return None


_FLUSH_ON_CLOSE_S = 0.5


def is_auth_refusal(exc: BaseException) -> bool:
    """Whether NATS refused the credentials (a wrong password, an unknown user)."""
    text = str(exc).lower()
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in text


def is_permission_violation(exc: BaseException) -> bool:
    """Whether NATS refused a publish or a subscribe to this connection's identity."""
    return "permissions violation" in str(exc).lower()


def redact(url: str) -> str:
    """``url`` (or a comma-separated list of them) without user names and passwords."""
    return ",".join(_USERINFO.sub(r"\1", part.strip()) for part in url.split(","))


async def close(nc: NatsClient) -> None:
    """Flush what was published (bounded), then close; never waits on a bus
    that is gone.

    Not ``drain()``: when nats-server stops at the same moment as this
    process (a node drain stops everything together), drain waits out its
    whole deadline on a connection that is reconnecting, and its cancelled
    inner futures are logged as never retrieved. What a stopping process
    needs is that its last acks and events reach the server: a flush does it.
    """
    if nc.is_connected:
        try:
            async with asyncio.timeout(_FLUSH_ON_CLOSE_S):
                await nc.flush()
        except Exception as exc:
            log.debug("flush of %s before closing failed: %r", nc.connected_url, exc)
    if nc.is_closed:
        return
    try:
        async with asyncio.timeout(_FLUSH_ON_CLOSE_S):
            await nc.close()
    except (OSError, RuntimeError, TimeoutError) as exc:
        # nats-py flushes publishes buffered during a reconnect into the
        # dead connection and raises (OSError on asyncio's loop, RuntimeError
        # "the handler is closed" on uvloop's): the connection is gone either way.
        log.debug("closing %s: %r", nc.connected_url, exc)
