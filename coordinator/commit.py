"""How an update ends: its writes, then its answer, then its announcement.

One order, for every update:

1. **Write.** A commit is first claimed: the in-flight record the update
   sent is rewritten, by compare-and-set on its revision, to carry the
   commit. A successor that took the update over (to roll it back) wrote
   that record first, and the claim fails: the term was deposed between
   its last look at the leader record and its commit (frozen past its
   lease, say), and answers ``not_leader`` instead. Then the commit point
   (the adapter's own committed record), then its result and the fleet's
   latest record, together; then the in-flight record is removed, by
   compare-and-set again. Any other result (a failure, "already
   committed") is written, and the in-flight record removed, only while
   this term still leads: a deposed term's successor rolled its update back
   and may have one of its own in flight.
2. **Answer.** The book resolves the request (``book.finish``), and every
   asker's reply task sends the result.
3. **Announce.** A commit's ``committed`` notice goes to every agent, once
   the answers are out (an agent that misses it reads the latest record
   when it reconnects, or hears the next term's).

So a requester told "committed" finds the commit in the store whoever leads
next, and nothing is owed after the answer. A coordinator that dies before
its answer leaves the in-flight record, from which a successor finishes the
commit (claimed, or the commit point stored) or rolls it back (neither):
``recovery.py``.
A commit's write that fails is tried again (0.2 s, doubling to 5 s) for a
lease; still failing, the term steps aside unanswered, and its requesters,
told ``not_leader``, ask whoever leads next, which recovers it the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import msgspec

from lorabus.adapters.bus_paths import key_of
from lorabus.coordinator.adapter_store import delete_unkept
from lorabus.coordinator.book import failed_result
from lorabus.coordinator.fit import fit_result
from lorabus.coordinator.inflight import Journalled
from lorabus.coordinator.signals import LeadershipLost, LostRace, SteppedAside, StoreUnavailable
from lorabus.coordinator.store import inflight_key, quietly, until_stored
from lorabus.coordinator.term import Term
from lorabus.errors import BusError
from lorabus.runtime.clock import now
from lorabus.schemas import (
    CommittedNotice,
    CommittedRecord,
    ErrorCode,
    ErrorInfo,
    UpdateRequest,
    UpdateResult,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Executed:
    """How an update ran: its result, and for a commit what it commits."""

    result: UpdateResult
    committed: CommittedRecord | None = None
    """The commit's record, stored (commit point, then latest) before the answer."""
    notice: CommittedNotice | None = None
    """What tells the agents of the commit, after the answer."""
    journalled: Journalled | None = None
    """The in-flight record the update sent: a commit is claimed on it, and it
    is removed once the result is stored."""


async def conclude(term: Term, request: UpdateRequest, executed: Executed, started: float) -> None:
    """Write, answer, announce (see the module docstring). Raises
    LeadershipLost once a deposed term has answered, SteppedAside when a
    commit could not be stored."""
    # Writes of other adapters' updates go on at once; a deletion from the
    # store never reads the records between these writes and the answer.
    async with term.records.writing():
        executed, leading = await _write_and_answer(term, request, executed, started)
    if executed.notice is not None:
        # The notice to N agents last: the answers do not queue behind it.
        await term.replies.sent(request.update_id)
        await announce(term, executed.notice)
    if executed.committed is not None:
        await retire_after(term, executed.committed)
    if not leading:
        # Deposed: step down now, not at the next lease renewal, so no later
        # request gets an answer from this term.
        raise LeadershipLost(f"epoch {term.epoch} was deposed during an update")


async def _write_and_answer(
    term: Term, request: UpdateRequest, executed: Executed, started: float
) -> tuple[Executed, bool]:
    """The writes, then the answer: what ran (a commit taken over by a
    successor becomes a ``not_leader`` answer), and whether this term still
    leads."""
    # One form for the store, the trail and every answer.
    result = fit_result(executed.result, term.max_payload())
    journalled = executed.journalled
    taken_over = False
    if executed.committed is not None and journalled is not None:
        journalled = await _claim_commit(term, journalled, executed.committed)
        if journalled is None:  # a successor took the update over
            taken_over = True
            committing = executed.committed.served_name
            executed = Executed(deposed_result(term, request, committing))
            result = executed.result
    if executed.committed is not None:
        # The update loop saw this term lead once the update had run.
        await _store_commit(term, executed.committed, result)
        leading = persisted = True
    else:
        # Taken over is deposed for sure, even when the leader record cannot
        # be read: its "not_leader" must never be stored as the outcome.
        leading = not taken_over and await term.still_leading()
        persisted = leading and await quietly(term.store.write_result(result))
    if leading and journalled is not None:
        await _clear_inflight(term, journalled)
    adapter = term.metrics.adapter_label(request.adapter)
    term.metrics.update_seconds.labels(adapter).observe(now() - started)
    term.metrics.updates.labels(result.status, adapter).inc()
    # Before the answer: a trail read once the answer is in holds the end of
    # the update (one publish, to the audit stream only).
    await term.bus.emit(term.finished(result))
    # Before the answer too: the requester may stop this process once it has
    # it (as a test, or a script, does).
    log.info(
        "epoch=%d update=%s %s %s",
        term.epoch,
        request.update_id,
        result.status,
        result.error.message if result.error else result.adapter,
    )
    term.book.finish(request, result, persisted=persisted)
    return executed, leading


def deposed_result(term: Term, request: UpdateRequest, committing: str | None) -> UpdateResult:
    """The answer of a term deposed while its update ran: its own outcome is
    none (a failure may be only the agents fencing it off), and the new
    leader answers a requester that asks again."""
    deposed = ErrorInfo(
        code=ErrorCode.NOT_LEADER,
        message=f"epoch {term.epoch} was deposed before "
        + (
            f"committing {committing}; the new leader rolls the update back"
            if committing is not None
            else "the update ended; ask again: the new leader answers"
        ),
    )
    return failed_result(request, deposed)


async def _claim_commit(
    term: Term, journalled: Journalled, committed: CommittedRecord
) -> Journalled | None:
    """Rewrite the update's in-flight record to carry ``committed``, by
    compare-and-set: the claimed record, or None when a successor took the
    update over first."""
    claim = msgspec.structs.replace(journalled.record, committing=committed)
    key = inflight_key(claim.adapter)

    async def swap() -> Journalled | None:
        revision = journalled.revision
        if revision is None:
            # A write failed: what is stored is read. None there is taken as
            # never stored (a successor's clear after its roll-back would look
            # the same; that needs this failure and a freeze at once).
            found, revision = await term.store.read_inflight_entry(key)
            if found is not None and found not in (journalled.record, claim):
                return None
            if found == claim:
                return Journalled(claim, revision)
        try:
            return Journalled(claim, await term.store.swap_inflight(key, claim, revision))
        except LostRace:
            # Ours, if an earlier try landed unanswered; else a successor's.
            found, revision = await term.store.read_inflight_entry(key)
            return Journalled(claim, revision) if found == claim else None

    try:
        claimed = await until_stored(swap, for_s=term.config.leader_lease_s)
    except StoreUnavailable as exc:
        raise SteppedAside(
            f"could not claim the commit of {committed.served_name} for a whole lease: {exc}"
        ) from exc
    if claimed is None:
        log.warning(
            "epoch=%d update=%s was taken over by a successor before its commit: not committed",
            term.epoch,
            journalled.record.update_id,
        )
    return claimed


async def _clear_inflight(term: Term, journalled: Journalled) -> None:
    """Remove the update's in-flight record, unless somebody wrote it since
    (a successor's own update, which must stay for its own successor)."""
    revision = journalled.revision
    key = inflight_key(journalled.record.adapter)
    try:
        if revision is None:
            found, revision = await term.store.read_inflight_entry(key)
            if found != journalled.record:
                return
        await term.store.clear_inflight(key, revision)
    except LostRace as exc:
        log.info("epoch=%d in-flight record left as found: %s", term.epoch, exc)
    except StoreUnavailable as exc:
        log.warning("store: %s", exc)


async def retire_after(term: Term, committed: CommittedRecord) -> None:
    """Delete from the adapter store what ``committed`` let go of (see
    coordinator/adapter_store.py): after the announcement, by the term that
    committed it, which knows the requests queued behind it. Never at the
    cost of the commit, nor of the term: what a failure leaves is swept later."""
    if not committed.dropped:
        return
    async with term.records.deleting():
        await housekeep(term, dropped=committed.dropped, sweep=False)


async def housekeep(term: Term, *, dropped: Sequence[str] = (), sweep: bool) -> None:
    """One round of deletions from the adapter store (a commit's ``dropped``,
    or a sweep), logged; whatever goes wrong is logged and left for the next
    sweep: housekeeping never ends a term."""
    try:
        deleted = await delete_unkept(
            term.store,
            term.adapters,
            dropped=dropped,
            in_use=lambda: {k for p in term.book.held_paths() if (k := key_of(p))},
            leading=term.still_leading,
            sweep=sweep,
            wall_now=time.time(),
        )
    except (StoreUnavailable, BusError) as exc:
        log.warning("epoch=%d could not delete retired adapters: %s", term.epoch, exc)
        return
    except Exception:
        log.exception("epoch=%d deleting retired adapters crashed", term.epoch)
        return
    if deleted:
        log.info("epoch=%d deleted retired adapters from the store: %s", term.epoch, deleted)


async def _store_commit(term: Term, committed: CommittedRecord, result: UpdateResult) -> None:
    """The commit point, then the result and the fleet's latest record
    together (a latest record must never name what no commit point holds),
    each tried again for a lease; then the term's book has it."""
    lease_s = term.config.leader_lease_s
    try:
        await until_stored(partial(term.store.commit, committed), for_s=lease_s)
        written = await asyncio.gather(
            until_stored(partial(term.store.write_result, result), for_s=lease_s),
            until_stored(partial(term.store.write_latest, committed), for_s=lease_s),
            return_exceptions=True,
        )
        for failed in written:
            if isinstance(failed, BaseException):
                raise failed
    except StoreUnavailable as exc:
        raise SteppedAside(
            f"could not store the commit of {result.update_id} for a whole lease: {exc}"
        ) from exc
    term.book.commit(committed)


async def announce_term(term: Term) -> None:
    """Tell every agent the committed state under this term's epoch: those
    outside any update learn the new epoch (and refuse the old leader) at
    once, and one that missed a notice converges."""
    committed = term.book.latest
    if committed is None:
        return
    notice = committed_notice(term, committed, update_id=f"term-{term.epoch}")
    await announce(term, notice)  # if lost, agents learn the epoch from a command


def committed_notice(
    term: Term, committed: CommittedRecord, *, update_id: str, retire: Sequence[str] = ()
) -> CommittedNotice:
    """The notice that tells every agent of ``committed`` under this term's
    epoch, with the versions of its adapter kept beside it (with it, what
    every engine serves of the adapter); ``retire``: the adapter's other
    served names each agent unloads where its engine holds them."""
    return CommittedNotice(
        update_id=update_id,
        budget_s=0.0,
        epoch=term.epoch,
        served_name=committed.served_name,
        path=committed.path,
        version=committed.version,
        retire=sorted(retire),
        lineage=committed.lineage,
        digest=committed.digest,
        adapter=committed.adapter,
        kept=committed.kept,
        workers=committed.workers,
    )


async def announce(term: Term, notice: CommittedNotice) -> None:
    try:
        await term.bus.broadcast(notice)
    except Exception as exc:  # the next term's notice, or a reconnect's read, converges
        log.warning("epoch=%d could not announce %s: %s", term.epoch, notice.served_name, exc)
