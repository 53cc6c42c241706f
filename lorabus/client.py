"""The orchestrator's side: ask a fleet's coordinator for an update, get the result.

    async with await UpdateClient.connect("nats://127.0.0.1:4222", fleet="prod") as bus:
        result = await bus.update("policy", "/ckpt/step_42", version=42)
        if result.committed:
            use(result.rank_map)

A lost answer is harmless: asking again with the same ``update_id`` (and the
same adapter, path and version) returns the first result without touching the
engines, and joins the update while it still runs. ``update()`` leans on that
to ride out a failover by itself: a leader that took the request can die,
freeze or be cut off without a word, so until an answer comes it asks again
every few seconds with the same id, and takes the first answer to any of its
asks. Each ask has a reply subject of its own under one subscription: a
secured server lets a coordinator send one response per request it heard,
and a re-ask that reaches it just after its answer to the previous one is
a request of its own, answered on its own subject. A successor answers from the results its
predecessor or its own roll-back left, or runs the update if nobody had
started it. ``not_leader`` (the coordinator stopped or lost its lease before
the update ended) is no answer either: it asks again while time is left.

A reply that does not decode (a responder that is not a coordinator of this
wire version, or lies) raises :class:`~lorabus.errors.MalformedReply`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import uuid
from collections.abc import Mapping
from typing import TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from lorabus.adapters.bus_paths import bus_path
from lorabus.adapters.store import push_adapter
from lorabus.bus.connect import close, connect
from lorabus.bus.options import BusOptions
from lorabus.errors import BadRequest, MalformedReply, NoCoordinator
from lorabus.runtime.clock import now
from lorabus.schemas import (
    FAILED,
    BadPayload,
    ErrorCode,
    ErrorInfo,
    FleetStatus,
    Reader,
    ResultRequest,
    StatusRequest,
    Subjects,
    UpdateMode,
    UpdateRequest,
    UpdateResult,
    check_tenant,
    encode,
    fleet_status_decoder,
    update_result_decoder,
)
from lorabus.schemas.bounds import MAX_KEEP

log = logging.getLogger(__name__)

_T = TypeVar("_T")

CONNECT_TIMEOUT_S = 10.0
"""How long connecting to NATS may take before ``BusUnreachable``."""
UPDATE_TIMEOUT_S = 300.0
"""How long ``update()`` waits for a result unless told otherwise."""
PUSH_TIMEOUT_S = 600.0
"""How long a push of an adapter to the fleet's object store may take."""
STATUS_TIMEOUT_S = 5.0
REASK_S = 3.0
"""Seconds without an answer after which ``update()`` asks again (same update id).

A few seconds: short beside a leader lease (5 s by default), so a successor
hears the request soon after it takes over, and long beside a reply's round
trip (milliseconds). Not shorter: while an update runs, each ask joins it and
the leader answers every one when it ends with the whole result (an entry per
member, about 0.5 MB at 1024 members); the client keeps only the first.
"""
NO_COORDINATOR_WAIT_S = 10.0
"""Seconds ``update()`` keeps asking while no coordinator listens at all before
it reports ``no_coordinator``: a killed leader's whole lease (5 s by default),
a standby's next look at the record (a quarter lease) and its recovery, so
that a request sent just after the leader died waits for the standby."""
STATUS_NO_COORDINATOR_WAIT_S = 2.0
"""The same for ``status()``: an operator wants to hear soon that nobody answers."""
_NO_RESPONDERS_PAUSE_S = 0.25
"""Pause before asking again when nobody listens: the server says so at once
and at no cost, and a successor subscribes only once it has recovered."""
_CLEANUP_S = 1.0
_STATUS_HEADER = "Status"
_NO_RESPONDERS_STATUS = "503"
"""How the server answers a request nobody listens to (what nats-py's own
``request()`` checks for ``NoRespondersError``)."""


class UpdateClient:
    """Asks one fleet's coordinator for updates and its status, over NATS."""

    def __init__(
        self,
        nc: NatsClient,
        fleet: str,
        *,
        owns_connection: bool = False,
        no_coordinator_wait_s: float = NO_COORDINATOR_WAIT_S,
        reask_s: float = REASK_S,
        tenant: str | None = None,
    ) -> None:
        """``tenant``: ask as this tenant of the fleet (its identity's
        ``LORABUS_TENANT``), on its own subjects; the update ids it makes
        begin with ``<tenant>:``, as the coordinator asks of a tenant's."""
        if reask_s <= 0:
            raise ValueError(f"reask_s must be > 0, got {reask_s}")
        self.nc = nc
        self.no_coordinator_wait_s = no_coordinator_wait_s
        self.reask_s = reask_s
        self.subjects = Subjects(fleet=fleet)
        self.tenant = check_tenant(tenant) if tenant else None
        self._owns_connection = owns_connection

    def _subject(self, kind: str) -> str:
        """Where ``kind`` requests go: the tenant's own subject, or the fleet's."""
        if self.tenant is not None:
            return self.subjects.tenant_request(self.tenant, kind)
        return {
            "update": self.subjects.update_request,
            "status": self.subjects.status_request,
            "result": self.subjects.result_request,
        }[kind]()

    def new_update_id(self) -> str:
        """A fresh update id (a tenant's begins with its name and ``:``)."""
        fresh = uuid.uuid4().hex
        return f"{self.tenant}:{fresh}" if self.tenant is not None else fresh

    @classmethod
    async def connect(
        cls,
        url: str,
        fleet: str,
        *,
        options: BusOptions | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        reask_s: float = REASK_S,
        tenant: str | None = None,
    ) -> UpdateClient:
        """A client of ``fleet`` on its own connection to ``url``, closed with it,
        as the identity ``options`` give (default: the ``LORABUS_*`` variables,
        as the CLI reads them; see :class:`~lorabus.BusOptions`).

        Raises :class:`~lorabus.errors.BusUnreachable` when NATS cannot be
        reached within ``connect_timeout_s``,
        :class:`~lorabus.errors.PermissionDenied` when it refuses the
        credentials, and :class:`~lorabus.errors.InsecureConnection` before
        exposing them (or the fleet) on an unprotected link.
        """
        nc = await connect(
            url,
            name=f"lorabus-client-{fleet}",
            options=options if options is not None else BusOptions.from_env(),
            connect_timeout_s=connect_timeout_s,
        )
        return cls(nc, fleet, owns_connection=True, reask_s=reask_s, tenant=tenant)

    async def __aenter__(self) -> UpdateClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_connection:
            await close(self.nc)

    async def push_adapter(
        self, directory: str | os.PathLike[str], *, timeout_s: float = PUSH_TIMEOUT_S
    ) -> str:
        """Store the adapter in ``directory`` in the fleet's object store and
        return its content digest, which an update names instead of a path
        (``update(adapter, digest=...)``): each agent fetches it into its
        node's cache, so trainer and workers share no filesystem. Content the
        store holds already is not sent again. Raises
        :class:`~lorabus.errors.BadRequest` for a directory that is not an
        adapter (no ``adapter_config.json``, no weights), before any upload.
        A tenant's client pushes into the tenant's own store, which no other
        tenant writes and its quota of bytes bounds."""
        store = self.subjects.for_store(self.tenant or "")
        digest, _ = await push_adapter(self.nc, store, directory, timeout_s=timeout_s)
        return digest

    async def update(
        self,
        adapter: str,
        path: str | None = None,
        *,
        version: int | None = None,
        update_id: str | None = None,
        timeout_s: float = UPDATE_TIMEOUT_S,
        digest: str | None = None,
        mode: UpdateMode | str | None = None,
        source: str | os.PathLike[str] | None = None,
        keep: int | None = None,
        replicas: int | None = None,
        selector: Mapping[str, str] | None = None,
    ) -> UpdateResult:
        """Request an update and wait for its result (committed or failed).

        The adapter comes from ``path``, a directory every worker sees at that
        path, or from the fleet's object store: by ``digest`` alone (pushed
        before with :meth:`push_adapter`), or from ``source``, a local
        directory pushed first. Give ``path`` or one of the others.

        ``digest`` (``sha256:...``, see :func:`lorabus.adapters.digest`) is what
        every member must see at ``path`` on its own host, or the update fails
        with ``digest_mismatch``; without it the members must agree among
        themselves. A committed result carries the digest they saw.

        ``mode`` ``live`` loads and verifies the new version on every member
        without pausing any engine: they keep serving the previous version
        until requests name the result's served name; ``pause`` pauses the
        fleet around the load; None leaves it to the coordinator's ``--mode``.

        ``keep`` (1 to 64): how many of the adapter's newest versions, this one
        among them, every engine serves once it commits (for async RL with
        staleness K, K + 1); the others of the adapter are unloaded, and no
        other adapter's. None leaves it to the coordinator's ``--keep``. It is
        not part of what ``update_id`` names: asked again with another
        ``keep``, an update id gets its first result.

        ``replicas`` and ``selector`` place the adapter on some workers only
        (live mode): ``replicas`` of them, among those whose labels (the
        agents' ``--label``) hold every label of ``selector``; the leader
        chooses, preferring those that serve the adapter now. The result's
        rank map and the commit point name them. None and {}: every worker.

        A request can reach a leader that dies before it answers (killed,
        frozen, cut off), or that stops leading and answers ``not_leader``;
        the coordinators cannot tell the requester, so until a final answer
        comes the request is sent again every ``reask_s`` seconds with the
        same ``update_id`` (a new random one per call if none is given),
        which a leader answers with that update's one result, its successor
        too. All within ``timeout_s``. Failing to hear back is reported as a
        ``failed`` result with code ``no_coordinator`` (nobody listened for
        ``no_coordinator_wait_s``) or ``timeout``; the update may still
        finish, and the same ``update_id`` fetches its result later.

        Every request with one ``update_id`` must ask for the same adapter,
        path and version (or no version): other content is answered
        ``bad_request``, naming what the id was first used for. A full queue
        at the coordinator answers ``busy`` at once; send the request again
        later. Raises :class:`~lorabus.errors.MalformedReply` when the reply
        does not decode.
        """
        if keep is not None and not 1 <= keep <= MAX_KEEP:
            raise BadRequest(f"keep must be 1 to {MAX_KEEP}, got {keep}")
        path, digest = await self._where(path, digest, source)
        request = UpdateRequest(
            update_id=update_id or self.new_update_id(),
            adapter=adapter,
            path=path,
            version=version,
            digest=digest,
            mode=None if mode is None else UpdateMode(mode),
            keep=keep,
            replicas=replicas,
            selector=dict(selector or {}),
        )
        return await self._ask_until_answered(request, timeout_s)

    async def _where(
        self,
        path: str | None,
        digest: str | None,
        source: str | os.PathLike[str] | None,
    ) -> tuple[str, str | None]:
        """The request's path and digest: ``path`` as given, else the bus path
        of ``digest``, or of ``source`` pushed first."""
        if path is not None:
            if source is not None:
                raise BadRequest("give a path or a source directory, not both")
            return path, digest
        if source is not None:
            pushed = await self.push_adapter(source)
            if digest is not None and digest != pushed:
                raise BadRequest(f"{source} holds {pushed}, not the digest given ({digest})")
            digest = pushed
        if digest is None:
            raise BadRequest("give the adapter's path, its digest, or a source directory")
        return bus_path(digest, self.tenant or ""), digest

    async def _ask_until_answered(self, request: UpdateRequest, timeout_s: float) -> UpdateResult:
        """Send ``request``, again every ``reask_s`` seconds, until a final
        answer or ``timeout_s``; a ``failed`` result of our own when none came."""
        subject = self._subject("update")
        started = now()
        asking = _Asking(request, started, deadline=started + timeout_s)
        # One subscription for every ask: an answer to an earlier ask counts as well.
        inbox = self.nc.new_inbox()
        replies = await self.nc.subscribe(f"{inbox}.*")
        asks = itertools.count(1)
        try:
            while not asking.over():
                await self.nc.publish(subject, encode(request), reply=f"{inbox}.{next(asks)}")
                result = await self._answer_to_ask(replies, asking)
                if result is not None:
                    return result
        finally:
            await _unsubscribe(replies)
        if asking.nobody_listened and not asking.taken:
            return self._unanswered(
                request,
                ErrorCode.NO_COORDINATOR,
                f"no coordinator is listening on fleet {self.subjects.fleet!r} "
                f"(waited {now() - started:.1f}s for one)",
            )
        last = f" (last answer: {asking.let_go.message})" if asking.let_go is not None else ""
        return self._unanswered(
            request,
            ErrorCode.TIMEOUT,
            f"no result within {timeout_s:.1f}s{last}; ask again with "
            f"update_id {request.update_id} for the outcome",
        )

    async def _answer_to_ask(self, replies: Subscription, asking: _Asking) -> UpdateResult | None:
        """The final answer heard before it is time to ask again, if any."""
        ask_again_at = min(now() + self.reask_s, asking.deadline)
        refused = False
        while (wait := ask_again_at - now()) > 0:
            try:
                reply = await replies.next_msg(timeout=wait)
            except TimeoutError:
                break
            if _is_no_responders(reply):
                # Nobody holds the fleet's request subject right now (the leader
                # died, a successor is recovering, or there is no coordinator).
                refused = asking.nobody_listened = True
                if not asking.taken and now() - asking.started >= self.no_coordinator_wait_s:
                    asking.nobody_came = True
                    return None
                ask_again_at = min(ask_again_at, now() + _NO_RESPONDERS_PAUSE_S)
                continue
            result = _decoded(
                reply, update_result_decoder, f"update result on {self._subject('update')}"
            )
            if result.error is not None and result.error.code == ErrorCode.NOT_LEADER:
                # The coordinator that had it let go: its successor will know.
                if asking.let_go != result.error:  # every ask that joined says it
                    log.info("update=%s %s: asking again", asking.update_id, result.error.message)
                asking.taken = True
                asking.let_go = result.error
                continue
            return result
        if not refused:
            asking.taken = True
            if not asking.over():  # a long update looks the same: not worth an INFO line
                log.debug(
                    "update=%s no answer within %.1fs: asking again",
                    asking.update_id,
                    self.reask_s,
                )
        return None

    async def status(self, *, timeout_s: float = STATUS_TIMEOUT_S) -> FleetStatus:
        """The fleet as its leader sees it: the live members, the latest commit,
        every adapter's commit (``adapters``: served name, version, digest,
        when, the versions kept beside it and which live members hold it),
        the update in flight. Raises NoCoordinator when nobody answers."""
        try:
            reply = await self._request(self._subject("status"), StatusRequest(), timeout_s)
        except (nats.errors.NoRespondersError, TimeoutError) as exc:
            raise NoCoordinator(
                f"no coordinator answered on fleet {self.subjects.fleet!r}"
            ) from exc
        return _decoded(reply, fleet_status_decoder, f"fleet status on {self._subject('status')}")

    async def result(self, update_id: str, *, timeout_s: float = STATUS_TIMEOUT_S) -> UpdateResult:
        """The outcome of an earlier update, by its id alone: a result whose
        ``status`` (an :class:`~lorabus.UpdateStatus`) is ``committed`` or
        ``failed`` once it has ended, ``pending`` while it is queued or runs,
        and ``unknown`` when no coordinator record of it is left (results are
        kept a day). Runs nothing; raises NoCoordinator when nobody answers."""
        request = ResultRequest(update_id=update_id)
        try:
            reply = await self._request(self._subject("result"), request, timeout_s)
        except (nats.errors.NoRespondersError, TimeoutError) as exc:
            raise NoCoordinator(
                f"no coordinator answered on fleet {self.subjects.fleet!r}"
            ) from exc
        return _decoded(reply, update_result_decoder, "update result")

    async def _request(self, subject: str, message: msgspec.Struct, timeout_s: float) -> Msg:
        # "No responders" is answered at once, also while a coordinator is
        # restarting, and a just-connected client can be told so for its first
        # request although the coordinator has subscribed: ask again briefly.
        retrying = AsyncRetrying(
            stop=stop_after_delay(min(self.no_coordinator_wait_s, STATUS_NO_COORDINATOR_WAIT_S)),
            wait=wait_exponential(multiplier=0.05, max=0.5),
            retry=retry_if_exception_type(nats.errors.NoRespondersError),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self.nc.request(subject, encode(message), timeout=timeout_s)
        raise AssertionError("tenacity either returns or re-raises")

    @staticmethod
    def _unanswered(request: UpdateRequest, code: ErrorCode, message: str) -> UpdateResult:
        return UpdateResult(
            update_id=request.update_id,
            status=FAILED,
            adapter=request.adapter,
            version=request.version,
            error=ErrorInfo(code=code, message=message),
        )


def _decoded(reply: Msg, reader: Reader[_T], what: str) -> _T:
    """The reply as ``reader`` decodes it; a malformed one raises MalformedReply."""
    try:
        return reader.decode(reply.data)
    except BadPayload as exc:
        raise MalformedReply(
            f"the reply is not a valid {what} ({len(reply.data)} bytes: {str(exc)[:200]}); "
            "is something other than a lorabus coordinator of this version answering there?"
        ) from None


class _Asking:
    """Where one ``update()`` call stands: its deadline and what it has heard."""

    def __init__(self, request: UpdateRequest, started: float, deadline: float) -> None:
        self.update_id = request.update_id
        self.started = started
        self.deadline = deadline
        self.taken = False
        """Whether a coordinator has had the request: nobody listening is then a
        failover in progress, not a fleet without a coordinator."""
        self.let_go: ErrorInfo | None = None
        """The last ``not_leader`` answer: a coordinator stopped leading before
        the update ended."""
        self.nobody_listened = False
        """Whether some ask found no coordinator listening."""
        self.nobody_came = False
        """Set when no coordinator listened for ``no_coordinator_wait_s``."""

    def over(self) -> bool:
        return self.nobody_came or now() >= self.deadline


def _is_no_responders(reply: Msg) -> bool:
    return not reply.data and (reply.headers or {}).get(_STATUS_HEADER) == _NO_RESPONDERS_STATUS


async def _unsubscribe(sub: Subscription) -> None:
    """Drop the reply inbox, so that later answers to earlier asks are not
    delivered; under its own short deadline, and nothing to undo on a closed
    connection."""
    with contextlib.suppress(nats.errors.Error, TimeoutError):
        async with asyncio.timeout(_CLEANUP_S):
            await sub.unsubscribe()
