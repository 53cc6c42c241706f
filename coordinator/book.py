"""The coordinator's book of updates: the queue, the results, the committed state.

One update runs at a time per fleet. Requests wait in arrival order; when one
is taken, queued requests for the same adapter with an older explicit version
are answered ``superseded`` (an RL trainer only wants its newest step served).
A repeated ``update_id`` gets the first request's result, whether that is
still queued, running, or done.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from lorabus.schemas import (
    FAILED,
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


def failed_result(request: UpdateRequest, error: ErrorInfo) -> UpdateResult:
    return UpdateResult(
        update_id=request.update_id,
        status=FAILED,
        adapter=request.adapter,
        version=request.version,
        error=error,
    )


class UpdateBook:
    def __init__(self) -> None:
        self.committed: dict[str, CommittedRecord] = {}
        self.latest: CommittedRecord | None = None
        self.running: str | None = None
        self._results: OrderedDict[str, UpdateResult] = OrderedDict()
        self._unpersisted: dict[str, UpdateResult] = {}
        self._pending: dict[str, tuple[UpdateRequest, asyncio.Future[UpdateResult]]] = {}
        self._queue: list[UpdateRequest] = []
        self._queued = asyncio.Event()
        self._closed_with: ErrorInfo | None = None

    def knows(self, update_id: str) -> bool:
        return (
            update_id in self._pending
            or update_id in self._results
            or update_id in self._unpersisted
        )

    def submit(self, request: UpdateRequest) -> asyncio.Future[UpdateResult]:
        """The future result of ``request`` (the first one's, for a repeated id)."""
        known = self._pending.get(request.update_id)
        if known is not None:
            return known[1]
        future: asyncio.Future[UpdateResult] = asyncio.get_running_loop().create_future()
        done = self._results.get(request.update_id) or self._unpersisted.get(request.update_id)
        if done is None and self._closed_with is not None:
            done = failed_result(request, self._closed_with)
        if done is not None:
            future.set_result(done)
            return future
        self._pending[request.update_id] = (request, future)
        self._queue.append(request)
        self._queued.set()
        return future

    async def next_request(self) -> UpdateRequest:
        """Wait for the next request to run; answers the ones it supersedes."""
        while not self._queue:
            self._queued.clear()
            await self._queued.wait()
        request = self._queue.pop(0)
        for newer in self._queue:
            if _supersedes(newer, request):
                self.finish(
                    request,
                    failed_result(
                        request,
                        ErrorInfo(
                            code=ErrorCode.SUPERSEDED,
                            message=f"version {newer.version} of {request.adapter!r} was requested "
                            f"(update {newer.update_id}) before this one could start",
                        ),
                    ),
                )
                return await self.next_request()
        self.running = request.update_id
        return request

    def finish(
        self, request: UpdateRequest, result: UpdateResult, *, persisted: bool = True
    ) -> None:
        """Answer ``request``; ``persisted``: the results bucket holds ``result``."""
        if self.running == request.update_id:
            self.running = None
        if not persisted:
            self._unpersisted[request.update_id] = result
        self._results[request.update_id] = result
        while len(self._results) > _REMEMBERED_RESULTS:
            self._results.popitem(last=False)
        _, future = self._pending.pop(request.update_id, (request, None))
        if future is not None and not future.done():
            future.set_result(result)

    def commit(self, committed: CommittedRecord) -> None:
        self.committed[committed.adapter] = committed
        self.latest = committed

    def close(self, error: ErrorInfo) -> None:
        """At the end of a term: answer everyone still waiting, and every later
        submission, with ``error`` instead of leaving them hanging."""
        self._closed_with = error
        for request, _ in list(self._pending.values()):
            self.finish(request, failed_result(request, error))
        self._queue.clear()


def _supersedes(newer: UpdateRequest, older: UpdateRequest) -> bool:
    return (
        newer.adapter == older.adapter
        and newer.version is not None
        and older.version is not None
        and newer.version > older.version
    )
