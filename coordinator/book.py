"""The coordinator's book of updates: the queue, the results, the committed state.

Updates of different adapters run at once, those of one adapter one at a
time: :meth:`UpdateBook.next_request` hands out, in arrival order, the first
queued request whose adapter has no update running, while fewer than
``max_running`` run. Pause-mode updates run in rounds, as each pauses the
whole fleet: when none runs, the pause-mode requests queued then (one per
adapter) form a round, which starts together and shares one pause of the
fleet (each names the others, :meth:`UpdateBook.round_of`); later ones wait
for the next round, once the whole round has ended, so the engines resume
between rounds. A new leader forms its first round only once its
predecessor's requesters have had a re-ask interval to ask it again
(:attr:`UpdateBook.rounds_from`): else the first to ask again would start a
round alone, and the others wait for it, again at every failover. A live
update pauses nothing and runs beside them.
Requests wait at most ``max_queued`` per adapter and ``max_queued_total`` in
all, and a tenant's at most its own quota (:class:`QueueShare`): one more is
answered ``busy``, saying which bound is full, at once and not kept, so the
same request may simply come again. A request
naming a version of an adapter answers the queued requests for older versions
of it ``superseded`` at once, and is itself answered ``superseded`` at once if
a newer one is already queued (an RL trainer only wants its newest step
served); so no queued request ever waits for nothing.

An update id names one update. The book keeps the first request of each id
(its content) beside the id's result; a repeated id with the same content
gets the first result, whether that is still queued, running or done (this
is how a requester asks again after a lost reply or a failover). With other
content it is answered ``bad_request``, naming the id's first content, and
not kept: the id stays the first request's. What the same content is, is
``update_ids.py``'s to say.

Where the first request is no longer known (after a failover, or once it has
left memory) the id's result from the results bucket stands for it: the
result names the adapter (or its served name) and the version it ran as, and
for a committed result whose version is still the adapter's committed one the
committed record gives its path.

What waits in the queue is the request as checked on arrival
(:class:`~lorabus.coordinator.plan.CheckedRequest`), which the update loop
plans when its turn comes.

Results the book decides without running anything (``superseded``, and the
refusals decided at arrival, through :meth:`UpdateBook.settle`) are handed
over through :meth:`UpdateBook.take_settled`, to be written to the results
bucket and announced like the results of updates run.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.plan import CheckedRequest
from lorabus.coordinator.update_ids import content_conflict, result_conflict
from lorabus.errors import BadRequest, Busy
from lorabus.runtime.clock import now
from lorabus.schemas import (
    COMMITTED,
    FAILED,
    PENDING,
    CommittedRecord,
    ErrorCode,
    ErrorInfo,
    UpdateRequest,
    UpdateResult,
)

_REMEMBERED_RESULTS = 16
"""Results carry an entry per worker (about 0.5 MB at 1024 workers); older ones
are answered from the fleet's results bucket, which keeps them for a day. A
result the bucket did not take is kept here for the whole term instead."""
_REMEMBERED_REQUESTS = 1024
"""First requests kept beyond their results (at most about 4.5 kB each), so a
repeated id is checked against its whole content while the term lasts."""


def book_of(config: CoordinatorConfig) -> UpdateBook:
    """A term's book, with the coordinator's bounds."""
    return UpdateBook(
        max_queued=config.max_queued,
        max_queued_total=config.max_queued_total,
        max_running=config.max_concurrent,
    )


def committed_result(
    update_id: str, committed: CommittedRecord, *, ran: bool = False
) -> UpdateResult:
    """The result ``committed`` stands for: with ``ran``, that of the update
    that made it (the digest its members agreed on included); else the
    answer to a request for exactly what is committed, which ran nothing."""
    return UpdateResult(
        update_id=update_id,
        status=COMMITTED,
        adapter=committed.served_name,
        version=committed.version,
        rank_map=committed.rank_map,
        path=committed.path,
        digest=committed.digest if ran else "",
    )


def failed_result(request: UpdateRequest, error: ErrorInfo) -> UpdateResult:
    return UpdateResult(
        update_id=request.update_id,
        status=FAILED,
        adapter=request.adapter,
        version=request.version,
        error=error,
        path=posixpath.normpath(request.path),
    )


@dataclass(frozen=True)
class QueueShare:
    """A bound on the waiting requests of some adapters: a tenant's
    (``tenants.py``), so that one tenant cannot fill the queue for all."""

    who: str
    max_queued: int
    owns: Callable[[str], bool]


class UpdateBook:
    def __init__(
        self, *, max_queued: int = 16, max_queued_total: int = 256, max_running: int = 1
    ) -> None:
        self.max_queued = max_queued
        """Requests that may wait per adapter."""
        self.max_queued_total = max_queued_total
        """Requests that may wait in all, whatever their adapters: a bound on
        a flood of adapter names."""
        self.max_running = max_running
        """Updates that may run at once (of different adapters)."""
        self.committed: dict[str, CommittedRecord] = {}
        self.latest: CommittedRecord | None = None
        self.lineages: dict[str, int] = {}
        """Each adapter's lineage, where this term has learned it."""
        self._running: dict[str, CheckedRequest] = {}
        """The updates running, by adapter, in the order they started."""
        self._round: list[str] = []
        """The ids of the pause-mode round that runs (or ran last)."""
        self.rounds_from = 0.0
        """No pause-mode round starts before then (monotonic)."""
        self._results: OrderedDict[str, UpdateResult] = OrderedDict()
        self._unpersisted: dict[str, UpdateResult] = {}
        self._requests: OrderedDict[str, UpdateRequest] = OrderedDict()
        self._pending: dict[str, tuple[UpdateRequest, asyncio.Future[UpdateResult]]] = {}
        self._queue: list[CheckedRequest] = []
        self._changed = asyncio.Event()
        """Set when a request joins the queue or an update ends: one may start."""
        self._settled: list[UpdateResult] = []
        self._closed_with: ErrorInfo | None = None

    @property
    def queued(self) -> int:
        """Requests waiting to run, of every adapter."""
        return len(self._queue)

    @property
    def running(self) -> str | None:
        """The id of the update running longest, if one runs."""
        return next((checked.update_id for checked in self._running.values()), None)

    def running_updates(self) -> list[CheckedRequest]:
        """The updates running, in the order they started."""
        return list(self._running.values())

    def held_paths(self) -> list[str]:
        """The adapter paths of the requests running and of those queued."""
        return [checked.request.path for checked in [*self._running.values(), *self._queue]]

    def outcome(self, update_id: str) -> UpdateResult | None:
        """The id's result if this term has it; ``pending`` while it is queued
        or running; None when this term does not know the id."""
        result = self._results.get(update_id) or self._unpersisted.get(update_id)
        if result is not None:
            return result
        pending = self._pending.get(update_id)
        if pending is None:
            return None
        request = pending[0]
        return UpdateResult(
            update_id=update_id,
            status=PENDING,
            adapter=request.adapter,
            version=request.version,
            path=posixpath.normpath(request.path),
        )

    def knows(self, update_id: str) -> bool:
        """Whether the id's result, or the future of it, is here (else it may be
        in the results bucket)."""
        return (
            update_id in self._pending
            or update_id in self._results
            or update_id in self._unpersisted
        )

    def submit(self, checked: CheckedRequest) -> asyncio.Future[UpdateResult]:
        """The future result of a request: :meth:`look_up`, else :meth:`enqueue`."""
        known = self.look_up(checked.request)
        return known if known is not None else self.enqueue(checked)

    def look_up(
        self,
        request: UpdateRequest,
        *,
        stored: UpdateResult | None = None,
        committed: CommittedRecord | None = None,
    ) -> asyncio.Future[UpdateResult] | None:
        """The future result of a request whose id is known, None for a new id.

        ``stored``: the id's result as the results bucket has it, when the book
        does not know the id; ``committed``: the adapter's committed record, if
        the book has none (to check a stored result's path against).
        """
        update_id = request.update_id
        if stored is not None and not self.knows(update_id):
            self._remember(stored)
        result = self._results.get(update_id) or self._unpersisted.get(update_id)
        pending = self._pending.get(update_id)
        first = pending[0] if pending is not None else self._requests.get(update_id)
        if first is not None:
            if pending is not None and first.version is None and request.version is not None:
                return self._checked_once_run(first, request, pending[1])
            conflict = content_conflict(first, request, result.version if result else None)
        elif result is not None:
            committed = self.committed.get(request.adapter) or committed
            conflict = result_conflict(request, result, committed)
        else:
            conflict = None
        if conflict is not None:
            return _done(failed_result(request, BadRequest(conflict).info()))
        if pending is not None:
            return pending[1]
        if result is not None:
            return _done(result)
        if self._closed_with is not None:
            return _done(failed_result(request, self._closed_with))
        return None

    def adapters_held(self) -> set[str]:
        """The adapters committed, queued or running."""
        return {*self.committed, *self._running, *(queued.adapter for queued in self._queue)}

    def enqueue(
        self, checked: CheckedRequest, share: QueueShare | None = None
    ) -> asyncio.Future[UpdateResult]:
        """Queue a request of a new id; answers at once the one of a request a
        queued one supersedes, the queued ones it supersedes, and a request that
        finds the queue full (``busy``, not kept): the queue, its adapter's
        part of it, or ``share``'s."""
        request = checked.request
        for queued in self._queue:
            if _supersedes(queued.request, request):
                return self.settle(request, _superseded(request, by=queued.request))
        for older in [queued for queued in self._queue if _supersedes(request, queued.request)]:
            self._queue.remove(older)
            self._settle(older.request, _superseded(older.request, by=request))
        full = self._full(request.adapter, share)
        if full is not None:
            return _done(failed_result(request, Busy(full).info()))
        future: asyncio.Future[UpdateResult] = asyncio.get_running_loop().create_future()
        self._pending[request.update_id] = (request, future)
        self._queue.append(checked)
        self._changed.set()
        return future

    def _full(self, adapter: str, share: QueueShare | None) -> str | None:
        """Why one more request of ``adapter`` may not wait, if a bound is full."""
        if share is not None:
            shared = sum(1 for queued in self._queue if share.owns(queued.adapter))
            if shared >= share.max_queued:
                return (
                    f"{shared} update requests of {share.who} already wait (its "
                    "max_queued); nothing was queued: ask again later"
                )
        if len(self._queue) >= self.max_queued_total:
            return (
                f"{len(self._queue)} update requests already wait, of every adapter "
                "(the coordinator's --max-queued-total); nothing was queued: ask again later"
            )
        waiting = sum(1 for queued in self._queue if queued.adapter == adapter)
        if waiting >= self.max_queued:
            return (
                f"{waiting} update requests of {adapter!r} already wait (the "
                "coordinator's --max-queued, per adapter); nothing was queued: ask again later"
            )
        return None

    def settle(self, request: UpdateRequest, result: UpdateResult) -> asyncio.Future[UpdateResult]:
        """Answer a request of a new id with ``result`` without running it (a
        refusal, or what is committed already): kept as the id's result, and
        handed over by :meth:`take_settled` to be written to the results bucket."""
        self._settle(request, result)
        return _done(result)

    def take_settled(self) -> list[UpdateResult]:
        """The results settled since the last call, to write and announce."""
        settled, self._settled = self._settled, []
        return settled

    def saved(self, update_id: str) -> None:
        """The results bucket now holds the id's result."""
        self._unpersisted.pop(update_id, None)

    async def next_request(self) -> CheckedRequest:
        """Wait for the next request that may start (see the module
        docstring), and count it running until :meth:`finish`."""
        while (checked := self._startable()) is None:
            self._changed.clear()
            held_s = self.rounds_from - now()
            if held_s > 0 and any(not queued.live for queued in self._queue):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(held_s):
                        await self._changed.wait()
            else:
                await self._changed.wait()
        if not checked.live and not self._pausing():
            self._round = self._next_round()
        self._queue.remove(checked)
        self._running[checked.adapter] = checked
        return checked

    def round_of(self, update_id: str) -> list[str]:
        """The other updates of ``update_id``'s pause-mode round: its pause is
        shared with theirs."""
        if update_id not in self._round:
            return []
        return [other for other in self._round if other != update_id]

    def _pausing(self) -> bool:
        return any(not running.live for running in self._running.values())

    def _startable(self) -> CheckedRequest | None:
        if len(self._running) >= self.max_running:
            return None
        pausing = self._pausing()
        may_open = not pausing and now() >= self.rounds_from
        passed: set[str] = set()  # an adapter's requests start in the order they came
        for checked in self._queue:
            if checked.adapter in passed or checked.adapter in self._running:
                continue
            if checked.live or may_open or (pausing and checked.update_id in self._round):
                return checked
            passed.add(checked.adapter)
        return None

    def _next_round(self) -> list[str]:
        """The pause-mode requests that start together now: the first queued
        request of each adapter with none running, where it is a pause-mode
        one, as many as may run."""
        seen = set(self._running)
        members: list[str] = []
        for checked in self._queue:
            if checked.adapter not in seen:
                seen.add(checked.adapter)
                if not checked.live:
                    members.append(checked.update_id)
        return members[: self.max_running - len(self._running)]

    def finish(
        self, request: UpdateRequest, result: UpdateResult, *, persisted: bool = True
    ) -> None:
        """Answer ``request``; ``persisted``: the results bucket holds ``result``."""
        update_id = request.update_id
        running = self._running.get(request.adapter)
        if running is not None and running.update_id == update_id:
            del self._running[request.adapter]
            self._changed.set()
        if not persisted:
            self._unpersisted[update_id] = result
        self._remember(result)
        first, future = self._pending.pop(update_id, (request, None))
        self._requests[update_id] = first
        self._requests.move_to_end(update_id)
        while len(self._requests) > _REMEMBERED_REQUESTS:
            self._requests.popitem(last=False)
        if future is not None and not future.done():
            future.set_result(result)

    def commit(self, committed: CommittedRecord) -> None:
        self.committed[committed.adapter] = committed
        self.latest = committed
        self.lineages[committed.adapter] = committed.lineage

    def learn(self, points: Iterable[CommittedRecord]) -> None:
        """Adapters' commit points as stored when this term began, for those
        this term has not committed or reset since: the status lists every
        adapter, and a request is checked against its commit point, without
        a read. The latest commit stays the one recovery found."""
        for point in points:
            if point.adapter not in self.committed and point.adapter not in self.lineages:
                self.committed[point.adapter] = point
                self.lineages[point.adapter] = point.lineage

    def reset(self, adapter: str, lineage: int) -> None:
        """An operator reset ``adapter``'s committed state: nothing of it is
        committed now, and its next commit belongs to ``lineage``."""
        self.committed.pop(adapter, None)
        self.lineages[adapter] = lineage
        if self.latest is not None and self.latest.adapter == adapter:
            self.latest = None

    def close(self, error: ErrorInfo) -> None:
        """At the end of a term: answer everyone still waiting, and every later
        submission, with ``error`` instead of leaving them hanging."""
        self._closed_with = error
        for request, _ in list(self._pending.values()):
            self.finish(request, failed_result(request, error))
        self._queue.clear()

    def _settle(self, request: UpdateRequest, result: UpdateResult) -> None:
        self.finish(request, result, persisted=False)
        self._settled.append(result)

    def _remember(self, result: UpdateResult) -> None:
        self._results[result.update_id] = result
        self._results.move_to_end(result.update_id)
        while len(self._results) > _REMEMBERED_RESULTS:
            self._results.popitem(last=False)

    def _checked_once_run(
        self, first: UpdateRequest, request: UpdateRequest, pending: asyncio.Future[UpdateResult]
    ) -> asyncio.Future[UpdateResult]:
        """The first request named no version and has not run yet: whether
        ``request``'s version is the one it runs as is known only then."""
        conflict = content_conflict(first, request, taken_as=None, version_known=False)
        if conflict is not None:
            return _done(failed_result(request, BadRequest(conflict).info()))
        checked: asyncio.Future[UpdateResult] = asyncio.get_running_loop().create_future()

        def check(done: asyncio.Future[UpdateResult]) -> None:
            if checked.done():
                return
            if done.cancelled():
                checked.cancel()
                return
            result = done.result()
            conflict = content_conflict(first, request, result.version)
            checked.set_result(
                failed_result(request, BadRequest(conflict).info()) if conflict else result
            )

        pending.add_done_callback(check)
        return checked


def _done(result: UpdateResult) -> asyncio.Future[UpdateResult]:
    future: asyncio.Future[UpdateResult] = asyncio.get_running_loop().create_future()
    future.set_result(result)
    return future


def _superseded(request: UpdateRequest, *, by: UpdateRequest) -> UpdateResult:
    return failed_result(
        request,
        ErrorInfo(
            code=ErrorCode.SUPERSEDED,
            message=f"version {by.version} of {request.adapter!r} was requested "
            f"(update {by.update_id}) before this one could start",
        ),
    )


def _supersedes(newer: UpdateRequest, older: UpdateRequest) -> bool:
    return (
        newer.adapter == older.adapter
        and newer.version is not None
        and older.version is not None
        and newer.version > older.version
    )
