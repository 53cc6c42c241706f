"""The leader's request subjects: update, result, status and reset.

Callbacks never wait for an update: they hand each request to a reply task
of the term (``term.py``), which admits it to the book and answers once its
result is known; the term answers or cancels those tasks when it ends.

Nothing a request claims is taken on trust. One that does not decode (not
JSON, nested too deeply, too large, an id or a version out of bounds) is
answered ``bad_request`` and reported as a ``bad_message`` event. An update
request is checked once, as it arrives (``plan.py``), and one that needs no
engine is answered on arrival, without queueing: invalid as given, a version
older than the committed one, exactly what is committed, a repeated update
id (its first result, or ``bad_request`` for other content; see
``book.py``), superseded by a queued one, or one past a full queue
(``busy``). So junk costs a pause only if it is a valid update, and at most
``--max-queued`` of those wait ahead of any request; an orchestrator's
credentials still allow that many, each a pause of the fleet.

What a request needs from outside the book is looked up as it arrives, at
once with other requests' look-ups, each under a deadline of its own: its
stored result and the adapter's committed record (for an id this term does
not know), its path checked, and the object it names in the fleet's store.
The requests of one adapter then join the book in the order they arrived,
each once the one before it has joined, on what the book holds at that
moment (its committed version, a queued request it supersedes or repeats).
So look-ups never add up, and a slow one holds only its own request and
those of its adapter that arrived after it, until it ends or its deadline
passes (``adapter_store.py``); other adapters' requests go by.
From its look on until its request has joined the queue or been refused,
the object is spared by the leader's deletions (``AdapterStore.admitting``).

Nor is where a request wants its answer: before anything else, a request
whose reply subject is no inbox (the store, the JetStream API, a command, an
ack, an event; ``bus.reply_refusal``) is refused and not acted on, counted
(``lorabus_replies_refused_total``) and reported as a ``bad_message`` event.
An update whose answer could go nowhere safe does not run: its requester
would never learn the outcome, and a refusal costs the fleet nothing.

The operator's reset of an adapter runs between its updates, in the
adapter's turn, never during a deletion from the store (``resets.py``).

A tenant's update, result and status requests come on subjects that name it,
and are held to its record (``tenants.py``): an update it may not ask for is
refused at arrival, before any look-up (so it learns nothing of another's
id), and again at its turn to join the book (its adapters quota, counted on
what the book holds then); neither refusal is kept as the id's result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from lorabus.adapters.bus_paths import key_of
from lorabus.coordinator.book import QueueShare, committed_result, failed_result
from lorabus.coordinator.bus import reply_refusal
from lorabus.coordinator.fit import fit_result, fit_status
from lorabus.coordinator.plan import CheckedRequest, check_request_off_loop, is_committed
from lorabus.coordinator.resets import reset_committed
from lorabus.coordinator.signals import StoreUnavailable
from lorabus.coordinator.store import or_none, quietly
from lorabus.coordinator.tenants import (
    Tenant,
    Tenants,
    forbidden,
    forbidden_on_generic,
    over_quota,
    result_for,
    status_for,
)
from lorabus.coordinator.term import Term
from lorabus.errors import BadRequest, LorabusError
from lorabus.schemas import (
    FAILED,
    UNKNOWN,
    BadPayload,
    CommittedRecord,
    ErrorCode,
    ErrorInfo,
    FleetStatus,
    Reader,
    ResetRequest,
    ResetResult,
    UpdateRequest,
    UpdateResult,
    encode,
    reset_request_decoder,
    result_request_decoder,
    update_request_decoder,
)

log = logging.getLogger(__name__)

_Serve = Callable[[Msg], Awaitable[None]]
_R = TypeVar("_R")


@dataclass(frozen=True)
class _Asker:
    """The tenant a request's subject names (``record`` None: none such is known)."""

    name: str
    record: Tenant | None


@dataclass(frozen=True)
class _LookedUp:
    """What a request's admission learned before its turn to join the book."""

    stored: UpdateResult | None
    """The id's result in the results bucket (looked for only when this term
    did not know the id: a predecessor may have finished or rolled it back)."""
    committed: CommittedRecord | None
    """The adapter's committed record as stored (likewise)."""
    checked: CheckedRequest | ErrorInfo
    """The request as checked, or why it is invalid as given."""
    not_stored: ErrorInfo | None = None
    """Why the object it names cannot be had from the store, if so."""


class Admission:
    """A term's request subscriptions and what they answer."""

    def __init__(
        self,
        term: Term,
        *,
        status: Callable[[], FleetStatus],
        own_inbox: str,
        tenants: Tenants | None = None,
        probe: bytes = b"",
    ) -> None:
        self.term = term
        self._status = status
        self._tenants = tenants or Tenants()
        self._probe = probe
        """The body of this coordinator's own probes (``service.py``), dropped unanswered."""
        self._own_inbox = own_inbox
        """This coordinator's inbox prefix, where no request may have its answer sent."""
        self._last_joined: dict[str, asyncio.Event] = {}
        """Adapter -> set once the latest request for it to arrive has joined
        the book (removed once it has)."""
        self._answering: dict[tuple[str, str], asyncio.Task[None]] = {}
        """(reply subject, update id) -> the task that will answer it."""

    async def subscribe(self, nc: NatsClient) -> list[Subscription]:
        """Serve the request subjects; the caller unsubscribes."""
        subjects = self.term.subjects
        served: dict[str, tuple[str, _Serve]] = {
            "update": (subjects.update_request(), self._on_update),
            "status": (subjects.status_request(), self._on_status),
            "result": (subjects.result_request(), self._on_result),
            "reset": (subjects.reset_request(), self._on_reset),
        }
        if self._tenants:
            served |= {
                f"tenant {kind}": (subjects.tenant_request_any(kind), serve)
                for kind, serve in (
                    ("update", self._on_update),
                    ("status", self._on_status),
                    ("result", self._on_result),
                )
            }
        return [
            await nc.subscribe(subject, cb=self._inbox_only(kind, serve))
            for kind, (subject, serve) in served.items()
        ]

    def _asker(self, msg: Msg) -> _Asker | None:
        """The tenant ``msg``'s subject names, if it came on a tenant's subject."""
        name = self.term.subjects.tenant_of(msg.subject)
        return None if name is None else _Asker(name, self._tenants.get(name))

    def _forbidden(self, asker: _Asker | None, request: UpdateRequest) -> ErrorInfo | None:
        """Why the request may not be asked for at all on the subject it came on."""
        if asker is None:
            return forbidden_on_generic(self._tenants, request.update_id, request.path)
        return forbidden(
            asker.name, self._tenants, request.update_id, request.adapter, request.path
        )

    def _over_quota(self, asker: _Asker, request: UpdateRequest) -> ErrorInfo | None:
        if asker.record is None:
            return None
        keep = self.term.config.keep if request.keep is None else request.keep
        held = self.term.book.adapters_held()
        return over_quota(asker.name, asker.record, request.adapter, keep, held)

    async def _refuse(
        self, msg: Msg, asker: _Asker | None, request: UpdateRequest, error: ErrorInfo
    ) -> None:
        """Answer an update that may not be asked for; nothing is kept of it."""
        who = asker.name if asker is not None else ""
        await self.term.reports.refused(who, "update", request.update_id, request.adapter, error)
        await self._reply(msg, failed_result(request, error))

    def _inbox_only(self, kind: str, serve: _Serve) -> _Serve:
        """``serve`` for requests whose answer may go where they ask; any other
        is refused before anything is done for it (see the module docstring)."""

        async def on_request(msg: Msg) -> None:
            if self._probe and msg.data == self._probe:
                return  # its own probe: it reached the subscription, which is all it asks
            why = reply_refusal(msg.reply, self.term.subjects, self._own_inbox)
            if why is None:
                await serve(msg)
                return
            self.term.metrics.replies_refused.labels(kind).inc()
            reply = msg.reply[:256]
            error = f"{kind} request refused, not acted on: its reply subject {reply!r} is {why}"
            await self.term.reports.bad_request(msg, error)

        return on_request

    # -- update -------------------------------------------------------------------

    async def _on_update(self, msg: Msg) -> None:
        request = await self._decoded(msg, "update", update_request_decoder, _result_refused)
        if request is None:
            return
        asker = self._asker(msg)
        if self._tenants and (refused := self._forbidden(asker, request)) is not None:
            self.term.replies.start(self._refuse(msg, asker, request, refused))
            return
        key = (msg.reply, request.update_id)
        if msg.reply and key in self._answering:
            # A requester asks again on the inbox of its first ask: one answer
            # reaches it. More would also break a server's one-response-per-
            # request permission (allow_responses) of a secured coordinator.
            return
        previous = self._last_joined.get(request.adapter)
        joined = self._last_joined[request.adapter] = asyncio.Event()
        reply = self.term.replies.start(self._answer(msg, request, previous, joined, asker))
        if msg.reply:
            self._answering[key] = reply
            reply.add_done_callback(lambda _: self._answering.pop(key, None))

    async def _answer(
        self,
        msg: Msg,
        request: UpdateRequest,
        previous: asyncio.Event | None,
        joined: asyncio.Event,
        asker: _Asker | None = None,
    ) -> None:
        """Reply with the request's result. Its look-ups run at once with other
        requests', but the requests of one adapter join the book in the order
        they arrived: each waits for the one before it (``previous``), and
        says when it has joined."""
        term = self.term
        try:
            async with self._looked_up(request) as looked_up:
                if previous is not None:
                    await previous.wait()
                admitted = self._admit(request, looked_up, asker)
        except Exception as exc:
            log.exception("epoch=%d update=%s could not be admitted", term.epoch, request.update_id)
            error = ErrorInfo(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
            await self._reply(msg, failed_result(request, error))
            return
        finally:
            joined.set()
            if self._last_joined.get(request.adapter) is joined:
                del self._last_joined[request.adapter]
        if isinstance(admitted, ErrorInfo):
            await self._refuse(msg, asker, request, admitted)
            return
        future = admitted
        await self._save_settled()
        if future.done():
            await self._reply(msg, future.result())
            return
        # Known as answering this update: its notice to the agents waits for us.
        with term.replies.answering(request.update_id):
            await self._reply(msg, await asyncio.shield(future))

    @contextlib.asynccontextmanager
    async def _looked_up(self, request: UpdateRequest) -> AsyncIterator[_LookedUp]:
        """What admitting ``request`` needs from outside the book, each look
        under its own deadline. The object it names is spared by the
        leader's deletions from before its look until this block ends (the
        request joined the book or was refused), whatever is awaited inside."""
        term = self.term
        stored: UpdateResult | None = None
        committed: CommittedRecord | None = None
        if not term.book.knows(request.update_id):
            stored, committed = await asyncio.gather(
                _stored_result(term, request.update_id),
                or_none(term.committed(request.adapter)),
            )
        try:
            checked = await check_request_off_loop(request, term.config)
        except LorabusError as exc:
            yield _LookedUp(stored, committed, exc.info())
            return
        pushed = key_of(checked.path)
        with term.adapters.admitting(pushed):
            not_stored = None
            if pushed is not None:
                try:
                    await term.adapters.check_stored(pushed)
                except LorabusError as exc:
                    not_stored = exc.info()
            yield _LookedUp(stored, committed, checked, not_stored)

    def _admit(
        self, request: UpdateRequest, looked_up: _LookedUp, asker: _Asker | None
    ) -> asyncio.Future[UpdateResult] | ErrorInfo:
        """The future result of ``request``, answered at once unless it must
        run, decided at its turn on what the book holds then (nothing is
        awaited here): the request was checked once, on arrival, and its
        version is checked against what is committed now (planned when it
        runs: the committed state may have moved on by then). A tenant's new
        id past its quotas: why, to refuse it. A tenant's request answered
        without running is not kept (its results would fill the fleet's
        results bucket): asked again, it is decided again."""
        book = self.term.book
        known = book.look_up(request, stored=looked_up.stored, committed=looked_up.committed)
        if known is not None:
            return known
        if asker is not None and (quota := self._over_quota(asker, request)) is not None:
            return quota
        settle = book.settle if asker is None else _answered
        checked = looked_up.checked
        if isinstance(checked, ErrorInfo):  # invalid as given
            return settle(request, failed_result(request, checked))
        committed = book.committed.get(request.adapter) or looked_up.committed
        try:
            version = checked.version(committed)
        except LorabusError as exc:
            return settle(request, failed_result(request, exc.info()))
        if committed is not None and is_committed(committed, version, checked.path):
            return settle(request, committed_result(request.update_id, committed))
        if looked_up.not_stored is not None:
            return settle(request, failed_result(request, looked_up.not_stored))
        if asker is None or asker.record is None:
            return book.enqueue(checked)
        tenant = asker.record
        return book.enqueue(
            checked, QueueShare(f"tenant {asker.name!r}", tenant.max_queued, tenant.owns)
        )

    async def _save_settled(self) -> None:
        """Write and announce the results the book settled without running them."""
        term = self.term
        for result in term.book.take_settled():
            if await quietly(term.store.write_result(result)):
                term.book.saved(result.update_id)
            await term.bus.emit(term.finished(result, ran=False))

    # -- result, status, reset ------------------------------------------------------

    async def _on_result(self, msg: Msg) -> None:
        request = await self._decoded(msg, "result", result_request_decoder, _result_refused)
        if request is not None:
            self.term.replies.start(self._answer_result(msg, request.update_id, self._asker(msg)))

    async def _answer_result(self, msg: Msg, update_id: str, asker: _Asker | None) -> None:
        """The id's outcome: this term's, else the results bucket's, else unknown
        (a store that cannot be read says so, rather than "unknown")."""
        outcome = self.term.book.outcome(update_id)
        if outcome is None:
            try:
                outcome = await self.term.store.read_result(update_id)
            except StoreUnavailable as exc:
                outcome = UpdateResult(
                    update_id=update_id,
                    status=FAILED,
                    adapter="",
                    version=None,
                    error=ErrorInfo(code=ErrorCode.INTERNAL, message=str(exc)),
                )
            except BadPayload:
                outcome = None
        outcome = outcome or UpdateResult(
            update_id=update_id, status=UNKNOWN, adapter="", version=None
        )
        if asker is not None:
            outcome = result_for(asker.name, outcome)
        await self._reply(msg, outcome)

    async def _on_status(self, msg: Msg) -> None:
        asker = self._asker(msg)
        if asker is None:
            await self._reply(msg, self._status())
        elif asker.record is not None:
            await self._reply(msg, status_for(asker.record, self._status()))

    async def _on_reset(self, msg: Msg) -> None:
        request = await self._decoded(msg, "reset", reset_request_decoder, _reset_refused)
        if request is not None:
            self.term.replies.start(self._answer_reset(msg, request))

    async def _answer_reset(self, msg: Msg, request: ResetRequest) -> None:
        term = self.term
        try:
            async with term.adapter_turn(request.adapter), term.records.writing():
                result = await reset_committed(term, request)
        except LorabusError as exc:
            result = ResetResult(adapter=request.adapter, ok=False, error=exc.info())
        except Exception as exc:
            log.exception("epoch=%d reset of %r crashed", term.epoch, request.adapter)
            error = ErrorInfo(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
            result = ResetResult(adapter=request.adapter, ok=False, error=error)
        await self._reply(msg, result)

    async def _decoded(
        self,
        msg: Msg,
        kind: str,
        reader: Reader[_R],
        refusal: Callable[[ErrorInfo], msgspec.Struct],
    ) -> _R | None:
        """The request in ``msg``; None once one that does not decode has been
        reported (``bad_message``) and answered ``bad_request`` (``refusal``)."""
        try:
            return reader.decode(msg.data)
        except BadPayload as exc:
            error = f"malformed {kind} request: {exc}"[:1024]
            await self.term.reports.bad_request(msg, error)
            await self._reply(msg, refusal(BadRequest(error).info()))
            return None

    async def _reply(self, msg: Msg, message: msgspec.Struct) -> None:
        """Answer ``msg``. A result or a status too large for one message goes
        trimmed (fit.py), whether it was made now or read from the store."""
        if isinstance(message, UpdateResult):
            message = fit_result(message, self.term.max_payload())
        elif isinstance(message, FleetStatus):
            message = fit_status(message, self.term.max_payload())
        if not msg.reply:
            return
        try:
            await msg.respond(encode(message))
        except Exception as exc:
            log.warning("could not reply on %s: %s", msg.reply, exc)


async def _stored_result(term: Term, update_id: str) -> UpdateResult | None:
    """The id's result in the results bucket; one that does not decode counts as none."""
    try:
        return await or_none(term.store.read_result(update_id))
    except BadPayload as exc:
        log.warning("the stored result of update %s does not decode, ignored: %s", update_id, exc)
        return None


def _answered(request: UpdateRequest, result: UpdateResult) -> asyncio.Future[UpdateResult]:
    """``result`` as the answer, kept nowhere."""
    future: asyncio.Future[UpdateResult] = asyncio.get_running_loop().create_future()
    future.set_result(result)
    return future


def _result_refused(error: ErrorInfo) -> UpdateResult:
    """The answer to an update or result request that names no update."""
    return UpdateResult(update_id="", status=FAILED, adapter="", version=None, error=error)


def _reset_refused(error: ErrorInfo) -> ResetResult:
    return ResetResult(adapter="", ok=False, error=error)
