"""The leader's update loop: one request at a time, from the book to its end.

Each request was checked as it arrived (``admission.py``); here it is planned
against what is committed when its turn comes (the committed state may have
moved while it waited, and a request without a version runs as one past the
committed one then), run (``lifecycle.py``), and concluded: written,
answered, announced (``commit.py``). An update holds the term's lock while
it runs and ends, so an operator's reset never lands in the middle of one.

An adapter whose commit point does not decode is reset to a new lineage
first (``resets.py``). A term deposed while its update ran answers
``not_leader``: its own outcome is no answer, and the new leader has the
update's.
"""

from __future__ import annotations

import logging
from typing import NoReturn

from lorabus.adapters.store import digest_of
from lorabus.coordinator.adapter_store import kept_beside
from lorabus.coordinator.book import committed_result, failed_result
from lorabus.coordinator.commit import Executed, conclude, deposed_result
from lorabus.coordinator.lifecycle import UpdateRunner
from lorabus.coordinator.plan import CheckedRequest, is_committed, retired_names
from lorabus.coordinator.resets import lineage, reset_unknown
from lorabus.coordinator.store import CorruptRecord
from lorabus.coordinator.term import Term
from lorabus.errors import LorabusError
from lorabus.runtime.cancellation import raise_if_cancelled
from lorabus.runtime.clock import now
from lorabus.schemas import CommittedNotice, CommittedRecord, ErrorCode, ErrorInfo, ResetRecord

log = logging.getLogger(__name__)


async def run_updates(term: Term, runner: UpdateRunner) -> NoReturn:
    while True:
        raise_if_cancelled()
        checked = await term.book.next_request()
        started = now()
        async with term.serial:
            executed = await _execute(term, runner, checked)
            await conclude(term, checked.request, executed, started)


async def _execute(term: Term, runner: UpdateRunner, checked: CheckedRequest) -> Executed:
    """Plan ``checked`` against what is committed now and run it; a commit
    comes back with its record and notice, for :func:`conclude`."""
    request = checked.request
    try:
        try:
            committed = await term.committed(request.adapter)
        except CorruptRecord as corrupt:
            await reset_unknown(term, request.adapter, corrupt)
            committed = None
        plan = checked.plan(committed, await lineage(term, request.adapter, committed))
        if committed is not None and is_committed(committed, plan.version, plan.path):
            return Executed(committed_result(request, committed))
        ran = await runner.run(plan)
        result = ran.result
        if not await term.still_leading():
            # Its own outcome is no answer: a failure may be only the agents
            # fencing this term off, and the new leader runs the update.
            committing = plan.served_name if result.committed else None
            return Executed(deposed_result(term, request, committing), journalled=ran.journalled)
        if not result.committed or result.rank_map is None:
            return Executed(result, journalled=ran.journalled)
        kept, dropped = kept_beside(
            digest_of(plan.path),
            committed,
            await _reset_of(term, plan.adapter) if committed is None else None,
            keep=term.config.keep,
        )
        record = CommittedRecord(
            adapter=plan.adapter,
            version=plan.version,
            path=plan.path,
            served_name=plan.served_name,
            rank_map=result.rank_map,
            lineage=plan.lineage,
            digest=result.digest,
            kept=kept,
            dropped=dropped,
        )
        # Versions of the adapter beyond ``keep``, among those the engines hold.
        loaded = {name for worker in result.workers.values() for name in worker.adapters}
        retire = [] if plan.replace else retired_names(plan.adapter, loaded, term.config.keep)
        notice = CommittedNotice(
            update_id=plan.update_id,
            budget_s=0.0,
            epoch=term.epoch,
            served_name=plan.served_name,
            path=plan.path,
            version=plan.version,
            retire=sorted(retire),
            lineage=plan.lineage,
            digest=result.digest,
        )
        return Executed(result, record, notice, journalled=ran.journalled)
    except LorabusError as exc:
        return Executed(failed_result(request, exc.info()))
    except Exception as exc:
        log.exception("update=%s crashed", request.update_id)
        crashed = ErrorInfo(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
        return Executed(failed_result(request, crashed))


async def _reset_of(term: Term, adapter: str) -> ResetRecord | None:
    """The adapter's latest reset, for the versions it kept; one that does not
    decode keeps nothing here (its objects are swept once unnamed)."""
    try:
        return await term.store.read_reset(adapter)
    except CorruptRecord:
        return None
