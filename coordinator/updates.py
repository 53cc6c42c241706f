"""The leader's update loop: each request from the book to its end.

The book hands out the requests that may start (updates of different
adapters at once, up to ``--max-concurrent``, one adapter's one at a time,
``book.py``); each runs as a task of the loop, which owns them: a term that
ends cancels every update it runs, and its successor finishes or rolls back
each from its in-flight record (``recovery.py``). A failure of one
adapter's update is its own result and touches no other update.

Each request was checked as it arrived (``admission.py``); here it is planned
against what is committed when its turn comes (the committed state may have
moved while it waited, and a request without a version runs as one past the
committed one then), run (``lifecycle.py``), and concluded: written,
answered, announced (``commit.py``). An update holds its adapter's turn while it
runs and ends, so an operator's reset of the adapter never lands in the
middle of one.

An adapter whose commit point does not decode is reset to a new lineage
first (``resets.py``). A term deposed while its update ran answers
``not_leader``: its own outcome is no answer, and the new leader has the
update's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import NoReturn

import msgspec

from lorabus.coordinator.adapter_store import kept_beside
from lorabus.coordinator.book import committed_result, failed_result
from lorabus.coordinator.commit import Executed, committed_notice, conclude, deposed_result
from lorabus.coordinator.lifecycle import UpdateRunner
from lorabus.coordinator.outcomes import RunOutcome
from lorabus.coordinator.placement import serving
from lorabus.coordinator.plan import CheckedRequest, UpdatePlan, is_committed, retired_names
from lorabus.coordinator.resets import lineage, reset_unknown
from lorabus.coordinator.signals import LeadershipLost, SteppedAside
from lorabus.coordinator.store import CorruptRecord
from lorabus.coordinator.term import Term
from lorabus.errors import LorabusError
from lorabus.runtime.cancellation import raise_if_cancelled
from lorabus.runtime.clock import now
from lorabus.schemas import CommittedRecord, ErrorCode, ErrorInfo, RankMap, ResetRecord

log = logging.getLogger(__name__)


async def run_updates(term: Term, runner: UpdateRunner) -> NoReturn:
    try:
        async with asyncio.TaskGroup() as updates:
            while True:
                raise_if_cancelled()
                checked = await term.book.next_request()
                updates.create_task(_run_one(term, runner, checked))
    except* LeadershipLost as ended:
        # One update found the term deposed, or could not store its commit:
        # the term ends as the update loop would have ended on its own.
        raise _first(ended) from None
    raise AssertionError("the update loop ended")  # for the type checker: it never does


async def _run_one(term: Term, runner: UpdateRunner, checked: CheckedRequest) -> None:
    term.metrics.updates_running.inc()
    try:
        async with term.adapter_turn(checked.adapter):
            started = now()
            executed = await _execute(term, runner, checked)
            await conclude(term, checked.request, executed, started)
    finally:
        term.metrics.updates_running.dec()


def _first(group: BaseExceptionGroup[LeadershipLost]) -> LeadershipLost:
    """The first leaf of ``group``: a stepped-aside term steps aside, else it is deposed."""
    leaves: list[LeadershipLost] = []
    pending: list[BaseException] = [group]
    while pending:
        error = pending.pop(0)
        if isinstance(error, BaseExceptionGroup):
            pending[:0] = list(error.exceptions)
        else:
            leaves.append(error)  # type: ignore[arg-type]
    return next((e for e in leaves if isinstance(e, SteppedAside)), leaves[0])


async def _execute(term: Term, runner: UpdateRunner, checked: CheckedRequest) -> Executed:
    """Plan ``checked`` against what is committed now and run it; a commit
    comes back with its record and notice, for :func:`conclude`."""
    request = checked.request
    try:
        committed = await _committed_now(term, request.adapter)
        plan = msgspec.structs.replace(
            checked.plan(committed, await lineage(term, request.adapter, committed)),
            shared_with=term.book.round_of(request.update_id),
            beside=serving(term.book.committed.values()),
        )
        if committed is not None and is_committed(committed, plan.version, plan.path):
            return Executed(committed_result(request.update_id, committed))
        ran = await runner.run(plan)
        result = ran.result
        if not await term.still_leading():
            # Its own outcome is no answer: a failure may be only the agents
            # fencing this term off, and the new leader runs the update.
            committing = plan.served_name if result.committed else None
            return Executed(deposed_result(term, request, committing), journalled=ran.journalled)
        if not result.committed or result.rank_map is None:
            return Executed(result, journalled=ran.journalled)
        return await _commit_of(term, plan, ran, committed, result.rank_map)
    except LorabusError as exc:
        return Executed(failed_result(request, exc.info()))
    except Exception as exc:
        log.exception("update=%s crashed", request.update_id)
        crashed = ErrorInfo(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
        return Executed(failed_result(request, crashed))


async def _committed_now(term: Term, adapter: str) -> CommittedRecord | None:
    """What is committed for ``adapter`` now; one whose commit point does not
    decode is reset to a new lineage first, and then nothing is."""
    try:
        return await term.committed(adapter)
    except CorruptRecord as corrupt:
        async with term.records.writing():
            await reset_unknown(term, adapter, corrupt)
        return None


async def _commit_of(
    term: Term,
    plan: UpdatePlan,
    ran: RunOutcome,
    committed: CommittedRecord | None,
    rank_map: RankMap,
) -> Executed:
    """A committed run's record (the adapter's versions it keeps beside it,
    ``plan.keep`` in all with it, and the object store digests it lets go
    of) and its notice, which retires the adapter's other versions among
    those the engines hold."""
    result = ran.result
    kept, dropped = kept_beside(
        plan.served_name,
        plan.path,
        committed,
        await _reset_of(term, plan.adapter) if committed is None else None,
        keep=plan.keep,
    )
    record = CommittedRecord(
        adapter=plan.adapter,
        version=plan.version,
        path=plan.path,
        served_name=plan.served_name,
        rank_map=rank_map,
        lineage=plan.lineage,
        digest=result.digest,
        kept=kept,
        dropped=dropped,
        committed_at=time.time(),
        workers=ran.placed,
        selector=plan.placement.selector if ran.placed else {},
    )
    retire: list[str] = []
    if not plan.replace:
        loaded = {name for worker in result.workers.values() for name in worker.adapters}
        served = {plan.served_name, *(version.served_name for version in kept)}
        retire = retired_names(plan.adapter, loaded, served)
    notice = committed_notice(term, record, update_id=plan.update_id, retire=retire)
    return Executed(result, record, notice, journalled=ran.journalled)


async def _reset_of(term: Term, adapter: str) -> ResetRecord | None:
    """The adapter's latest reset, for the versions it kept; one that does not
    decode keeps nothing here (its objects are swept once unnamed)."""
    try:
        return await term.store.read_reset(adapter)
    except CorruptRecord:
        return None
