"""Connecting to NATS with settings that fail fast and notice dead links early,
and waiting for it where a process must outlast it.

nats-py's defaults suit long-lived services badly here: the first connect
retries for about two minutes on a wrong URL, and a dead link is noticed only
after two minutes of pings. Every lorabus process connects through this module.

A command (``update``, ``status``) connects with :func:`connect`, which gives
up after a deadline. A serving process (coordinator, agent, following tap)
must not exit because NATS is slow or away, at start or later:
:func:`wait_connected` and :func:`wait_flushed` try again with a growing
pause for as long as it takes (:func:`until_answered`), saying so once, then
once a minute, and once more when the bus answers. What trying again cannot
mend (credentials or a certificate refused, options that expose credentials,
malformed options) still raises at once. Once connected, nats-py reconnects
on its own, without end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js
from nats.aio.client import Client as NatsClient
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_base,
    retry_if_exception,
    retry_if_result,
    wait_exponential,
    wait_random,
)

from lorabus.bus.options import BusOptions
from lorabus.errors import BadRequest, BusError, BusUnreachable, PermissionDenied
from lorabus.runtime.clock import now

log = logging.getLogger(__name__)

_T = TypeVar("_T")


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
    handed, and need not know which role it runs as; and that outlives a
    flush that timed out (nats-py 2.16 does not)."""

    def __init__(self, js_api_prefix: str | None = None) -> None:
        super().__init__()
        self.js_api_prefix = js_api_prefix

    def jetstream(self, **options: Any) -> nats.js.JetStreamContext:
        if self.js_api_prefix and "prefix" not in options and "domain" not in options:
            options["prefix"] = self.js_api_prefix
        return super().jetstream(**options)

    async def _process_pong(self) -> None:
        # nats-py's flush() cancels its future when it times out, but leaves
        # it queued: the PONG that answers it once the server is back would
        # raise InvalidStateError in the read loop, which then stops reading
        # for good (a deaf client, until its pings call the link stale). That
        # PONG is the one the flush gave up on: take both off the queue.
        if self._pongs and self._pongs[0].done():
            self._pongs.pop(0)
            self._pongs_received += 1
            self._pings_outstanding = 0
            return
        await super()._process_pong()


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

    async def wait_connected(self, name: str, *, who: str | None = None) -> NatsClient:
        """:func:`wait_connected` to this bus."""
        return await wait_connected(self.url, name=name, options=self.options, who=who)


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
    reached = await _connect_once(url, name, options, connect_timeout_s)
    if isinstance(reached, BusUnreachable):
        raise reached
    return reached


async def wait_connected(
    url: str,
    *,
    name: str,
    options: BusOptions | None = None,
    who: str | None = None,
    attempt_s: float = 5.0,
) -> NatsClient:
    """:func:`connect`, for as long as NATS takes to answer: a serving process
    waits for its bus. Each attempt lasts up to ``attempt_s`` (nats-py tries
    every half second meanwhile), then a pause growing to 10 s; ``who`` (by
    default ``name``) opens the log lines that say it waits.

    Raises at once what trying again cannot mend, as :func:`connect` does:
    :class:`InsecureConnection`, :class:`BadRequest`, :class:`PermissionDenied`
    (credentials or a client certificate refused) and the
    :class:`BusUnreachable` of a server certificate this client cannot verify.
    """
    reached = await until_answered(
        lambda: _connect_once(url, name, options, attempt_s),
        who=who or name,
        doing="connecting to NATS",
        retry=retry_if_result(lambda reached: isinstance(reached, BusUnreachable)),
    )
    if isinstance(reached, BusUnreachable):  # never: such an outcome is tried again
        raise reached
    return reached


async def _connect_once(
    url: str, name: str, options: BusOptions | None, timeout_s: float
) -> NatsClient | BusUnreachable:
    """One attempt of :func:`connect`: the connection, or the BusUnreachable
    of an attempt that trying again may mend. What it cannot mend is raised."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    options = options or BusOptions()
    try:
        identity = options.nats_kwargs(servers)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    nc = FleetConnection(options.js_api_prefix)
    link = _Link(nc, name, redact(url), nodes=len(servers))
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
            error_cb=link.on_error,
            disconnected_cb=link.on_disconnect,
            reconnected_cb=link.on_reconnect,
            **identity,
        )
    )
    try:
        unreachable = await link.first_connect(connecting, timeout_s)
    except BaseException:
        await _abandon(nc, connecting)
        raise
    if unreachable is not None:
        await _abandon(nc, connecting)
        return unreachable
    return nc


class _Link:
    """What one connection's callbacks see: its errors, losses and returns,
    logged; before its first connection, the failures that end the attempt
    (credentials or a certificate refused by every node) and the last one
    seen, to say why it did not connect."""

    def __init__(self, nc: NatsClient, name: str, where: str, *, nodes: int) -> None:
        self._nc, self._name, self._where, self._nodes = nc, name, where, nodes
        self._refused: asyncio.Future[BusError] = asyncio.get_running_loop().create_future()
        self._refusals = 0
        self._last_error: Exception | None = None
        """What the last try of this attempt failed with, to say why it did."""

    async def first_connect(
        self, connecting: asyncio.Future[Any], timeout_s: float
    ) -> BusUnreachable | None:
        """Wait up to ``timeout_s`` for ``connecting``: None once connected, the
        BusUnreachable of an attempt that trying again may mend; a refusal
        is raised."""
        either: set[asyncio.Future[Any]] = {connecting, self._refused}
        await asyncio.wait(either, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if self._refused.done() and not (connecting.done() and connecting.exception() is None):
            raise self._refused.result()
        if not connecting.done():
            last = f" (last: {_said(self._last_error)})" if self._last_error is not None else ""
            return BusUnreachable(
                f"cannot reach NATS at {self._where} within {timeout_s:.0f}s{last}"
            )
        try:
            connecting.result()
        except (OSError, nats.errors.Error) as exc:
            unreachable = BusUnreachable(f"cannot reach NATS at {self._where}: {_said(exc)}")
            unreachable.__cause__ = exc
            return unreachable
        return None

    async def on_error(self, exc: Exception) -> None:
        nc = self._nc
        final = None if nc.is_connected else _refusal(exc, self._where)
        if final is not None and not self._refused.done():
            # nats-py would retry the same credentials forever; in a cluster,
            # another node may still take them, so every node gets its turn.
            self._refusals += 1
            if self._refusals >= self._nodes:
                self._refused.set_result(final)
        if is_permission_violation(exc):
            # Refused by this identity's permissions: a set-up to fix, said by name.
            log.error("nats (%s): %s", self._name, str(exc).removeprefix("nats: ").strip("'"))
            return
        if not nc.is_connected:
            self._last_error = exc
        # Before the first connection, failures are summed up by the errors raised.
        log.log(
            logging.WARNING if nc.is_connected or nc.is_reconnecting else logging.DEBUG,
            "nats (%s): %s",
            self._name,
            exc,
        )

    async def on_disconnect(self) -> None:
        if not (self._nc.is_closed or self._nc.is_draining):
            log.warning("nats (%s): disconnected, reconnecting", self._name)

    async def on_reconnect(self) -> None:
        log.info("nats (%s): reconnected", self._name)


def _said(exc: BaseException) -> str:
    """What ``exc`` says; its type where it says nothing (a TimeoutError)."""
    return str(exc) or type(exc).__name__


async def _abandon(nc: NatsClient, connecting: asyncio.Future[Any]) -> None:
    """Stop a connection attempt that did not succeed."""
    connecting.cancel()
    await asyncio.gather(connecting, return_exceptions=True)
    # A client that never connected cannot close cleanly (nats-py asserts).
    with contextlib.suppress(Exception):
        await nc.close()


_FLUSH_TIMEOUT_S = 5
_PAUSES = wait_exponential(multiplier=0.5, max=10.0) + wait_random(0, 0.5)
"""Between two tries at the bus: 0.5 s doubling to 10 s, and a jitter, so
that a fleet's processes do not all knock at once when NATS comes back."""
STILL_WAITING_EVERY_S = 60.0
"""How often a process that still waits for its bus says so again."""


async def flushed(nc: NatsClient, timeout_s: int = _FLUSH_TIMEOUT_S) -> None:
    """Return once the server has read everything ``nc`` sent so far, its
    subscriptions just made among it: from then on they take every other
    connection's messages. Two flushes, since one does not prove it:
    nats-py writes a flush's PING straight to the socket, ahead of the
    commands its flusher task has not written yet, so the first PONG can
    come back before the server has read a subscription made just before
    (seen under load: a test's subscriber missed every message another
    connection sent right after). The first flush lets the flusher write
    them; the second PING goes out behind them."""
    await nc.flush(timeout=timeout_s)
    await nc.flush(timeout=timeout_s)


async def wait_flushed(nc: NatsClient, *, who: str) -> None:
    """Wait until the server has what ``nc`` sent (its subscriptions, say),
    for as long as the bus takes to answer; ``who`` opens the log lines that
    say it waits. A closed connection raises (no wait can mend it)."""
    await until_answered(
        lambda: flushed(nc),
        who=who,
        doing="flushing to NATS",
        retry=retry_if_exception(is_transient),
    )


def is_transient(exc: BaseException) -> bool:
    """Whether a failed call to NATS may work once the bus answers again (a
    timeout, a link being re-made), rather than never (a closed connection)."""
    if isinstance(exc, nats.errors.ConnectionClosedError | nats.errors.ConnectionDrainingError):
        return False
    return isinstance(exc, TimeoutError | nats.errors.Error | OSError)


async def until_answered(
    call: Callable[[], Awaitable[_T]], *, who: str, doing: str, retry: retry_base
) -> _T:
    """``call()``, again after a growing pause (0.5 s to 10 s) while ``retry``
    says its outcome may mend once the bus answers; any other outcome is
    returned or raised. Said at WARNING once when the waiting starts, again
    every :data:`STILL_WAITING_EVERY_S`, and at INFO when it ends: never a
    line per try."""
    began = now()
    said_at: float | None = None

    def say(state: RetryCallState) -> None:
        nonlocal said_at
        outcome = state.outcome
        assert outcome is not None  # tenacity sleeps only after an attempt
        failure = outcome.exception() if outcome.failed else outcome.result()
        cause = _said(failure) if isinstance(failure, BaseException) else failure
        if said_at is None:
            log.warning(
                "%s waiting for the bus: %s failed (%s); trying again with a growing pause",
                who,
                doing,
                cause,
            )
        elif now() - said_at >= STILL_WAITING_EVERY_S:
            log.warning(
                "%s still waiting for the bus after %.0fs: %s failed (%s)",
                who,
                now() - began,
                doing,
                cause,
            )
        else:
            return
        said_at = now()

    async def attempt() -> _T:  # a coroutine function, as tenacity wants to see
        return await call()

    # No stop: a serving process waits as long as it takes, until cancelled.
    result: _T = await AsyncRetrying(retry=retry, wait=_PAUSES, before_sleep=say)(attempt)
    if said_at is not None:
        log.info("%s done waiting for the bus after %.0fs: %s", who, now() - began, doing)
    return result


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
    if isinstance(exc, ssl.SSLError) and _is_refused_certificate(exc):
        return PermissionDenied(
            f"TLS: NATS at {where} refused this client ({exc.reason or exc}); it needs a "
            "client certificate from the server's CA (--tls-cert, --tls-key)"
        )
    return None


def _is_refused_certificate(exc: ssl.SSLError) -> bool:
    """Whether the server refused this client's certificate (a TLS alert),
    not a handshake cut short (a server restarting: ``SSLEOFError``, a reset),
    which trying again mends."""
    if isinstance(exc, ssl.SSLEOFError | ssl.SSLZeroReturnError | ssl.SSLSyscallError):
        return False
    return "ALERT" in str(getattr(exc, "reason", "") or exc).upper()


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
                await flushed(nc)
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
