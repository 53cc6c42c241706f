"""What a new leader does first: take over what its predecessor left.

It reads the fleet's records whole before it acts on any of them, and reads
them again until it can (a commit point that could not be read is no
evidence that there is none: rolling back on it would withdraw a version
whose requester was told it committed). It serves nothing meanwhile, and
after a lease of failed reads it steps aside, so that a standby may try.

Then, for each update found in flight (one record per adapter, as updates
of different adapters run at once; ``inflight`` is a version-6 leader's
single record), all at once:

- its commit point is stored: it committed (its requester may not have been
  told yet). Its result and the fleet's latest record are written, those
  that did not land;
- its record carries the commit its predecessor claimed (``commit.py``):
  the commit point is written if it is missing, then as above;
- no commit point and no result: the record is first marked as taken over
  by this term, by compare-and-set (a predecessor that was only frozen
  cannot claim the commit after that, and one that claimed it first makes
  this term read the record again and finish the commit); then it is
  rolled back (every member it named resumed, the version withdrawn) and
  that result recorded, so a requester retrying the same update id gets a
  terminal answer;
- its adapter's commit point does not decode: whether it committed is
  unknown, so every member is resumed, nothing withdrawn, nothing recorded;
- the in-flight record itself does not decode: every live member is resumed.

Then each in-flight record is removed, if nobody wrote it since. A record of the store that does not
decode is reported (``bad_message``) with what is done about it. Last, the
term's book learns every adapter's commit point, so that its status lists
every adapter, also those its predecessors committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import msgspec

from lorabus.coordinator.book import committed_result
from lorabus.coordinator.lifecycle import UpdateRunner
from lorabus.coordinator.signals import LeadershipLost, LostRace, SteppedAside, StoreUnavailable
from lorabus.coordinator.store import (
    INFLIGHT,
    CorruptRecord,
    FleetStore,
    quietly,
    until_stored,
)
from lorabus.coordinator.term import Term
from lorabus.schemas import (
    FAILED,
    BadPayload,
    CommittedRecord,
    InflightRecord,
    Phase,
    UpdateResult,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_TAKE_OVER_TRIES = 3
_REMEDIES = {
    False: "read as absent: an adapter whose commit point it is is reset at its next update, "
    "and the latest record is rewritten at the next commit",
    True: "read as an update of unknown content: every live member resumed, nothing withdrawn",
}
"""What recovery does with a committed record, and an in-flight record, that
does not decode."""


async def recover(term: Term, runner: UpdateRunner) -> list[str]:
    """Load the committed state; finish or roll back every update a
    predecessor left in flight, and return their ids; then learn every
    adapter's commit point."""
    reported = False
    for _ in range(_TAKE_OVER_TRIES):
        found = await _read_left_state(term)
        if not reported:
            reported = True
            for corrupt in found.corrupt:
                await term.reports.corrupt(corrupt, remedy=_REMEDIES[_is_inflight(corrupt.key)])
        if found.committed is not None:
            term.book.commit(found.committed)
        taken = await asyncio.gather(
            *(_take_over(term, runner, flight) for flight in found.flights),
            return_exceptions=True,
        )
        for outcome in taken:
            if isinstance(outcome, BaseException) and not isinstance(outcome, _Raced):
                raise outcome
        if any(isinstance(outcome, _Raced) for outcome in taken):
            log.warning(
                "epoch=%d an update in flight changed while this term took it over "
                "(its predecessor claimed its commit): reading them again",
                term.epoch,
            )
            continue
        await _learn_commit_points(term)
        return [update_id for update_id in taken if isinstance(update_id, str)]
    raise SteppedAside(
        f"the updates in flight changed under {_TAKE_OVER_TRIES} take-overs: stepping aside"
    )


def _is_inflight(key: str) -> bool:
    return key == INFLIGHT or key.startswith(f"{INFLIGHT}.")


async def _take_over(term: Term, runner: UpdateRunner, found: _LeftFlight) -> str | None:
    """Finish or roll back the update ``found`` holds; raises _Raced when its
    predecessor wrote the record meanwhile (the caller reads it again)."""
    in_flight, recorded, commit_point = found.in_flight, found.result, found.commit_point
    if in_flight is None:
        # It does not decode: an update of unknown content.
        await _resume_everyone(term, runner)
        await _clear(term, found.key, found.revision)
        return None
    revision = found.revision
    if in_flight.committing is not None and not _records_commit_of(commit_point, in_flight):
        # Its predecessor claimed the commit and may have stopped before
        # the commit point: it is written here, never rolled back.
        commit_point = in_flight.committing
        await _store_commit_point(term, in_flight, commit_point)
    if _records_commit_of(commit_point, in_flight):
        # It stopped after its commit point (every member had resumed),
        # maybe before its result and the latest record were written:
        # rolling back would withdraw a committed version.
        assert commit_point is not None
        await _record_commit(term, in_flight, commit_point, recorded)
        # What the term that ran it would have deleted after its answer, at
        # this term's first sweep: the requests its predecessor had queued
        # behind it are in this term's book only once asked again.
        term.adapters.defer(commit_point.dropped)
    elif recorded is None:
        # Taken over first, so that a predecessor frozen past its lease, all
        # its acks in hand, can no longer claim the commit once it wakes.
        taken = await _mark_taken_over(term, found.key, in_flight, revision)
        if taken is None:
            raise _Raced
        revision = taken
        if found.commit_point_unknown:
            # It may have committed: resume everyone, withdraw nothing, and
            # record no outcome (its adapter is reset at its next update).
            await _resume_everyone(term, runner, in_flight)
        else:
            await _roll_back(term, runner, in_flight)
    await _clear(term, found.key, revision)
    return in_flight.update_id


async def _learn_commit_points(term: Term) -> None:
    """Every adapter's commit point into the book, once what was in flight
    is settled: the status lists every adapter committed before this term.
    Read once: the status is not worth a term, and a listing that fails
    leaves it the adapters this term commits and the latest one. One that
    does not decode is left out (its adapter is reset at its next update,
    and reported then)."""
    try:
        points, corrupt = await term.store.read_commit_points()
    except StoreUnavailable as exc:
        log.warning(
            "epoch=%d could not read every adapter's commit point; the status lists "
            "those this term commits: %s",
            term.epoch,
            exc,
        )
        return
    term.book.learn(points.values())
    if corrupt:
        log.warning(
            "epoch=%d commit points that do not decode, left out of the status: %s",
            term.epoch,
            ", ".join(c.key for c in corrupt),
        )


class _Raced(Exception):
    """A take-over lost its compare-and-set to the predecessor."""


async def _mark_taken_over(
    term: Term, key: str, in_flight: InflightRecord, revision: int
) -> int | None:
    """Rewrite the in-flight record as taken over by this term, by
    compare-and-set: its new revision, or None when somebody wrote it first."""
    if in_flight.taken_over_by == term.epoch:
        return revision  # an earlier try of this term landed
    mine = msgspec.structs.replace(in_flight, taken_over_by=term.epoch)
    try:
        return await until_stored(
            partial(term.store.swap_inflight, key, mine, revision), for_s=term.config.leader_lease_s
        )
    except LostRace:
        return None
    except StoreUnavailable as exc:
        raise SteppedAside(
            f"could not take over {in_flight.update_id} for a whole lease: {exc}"
        ) from exc


async def _store_commit_point(
    term: Term, in_flight: InflightRecord, committed: CommittedRecord
) -> None:
    log.warning(
        "epoch=%d update=%s found in flight with its commit claimed: committing it",
        term.epoch,
        in_flight.update_id,
    )
    try:
        await until_stored(partial(term.store.commit, committed), for_s=term.config.leader_lease_s)
    except StoreUnavailable as exc:
        raise SteppedAside(
            f"could not store the claimed commit of {in_flight.update_id} for a whole lease: {exc}"
        ) from exc


async def _clear(term: Term, key: str, revision: int) -> None:
    """Remove the in-flight record under ``key`` if it is still revision ``revision``."""
    try:
        await term.store.clear_inflight(key, revision)
    except LostRace as exc:
        log.info("epoch=%d in-flight record left as found: %s", term.epoch, exc)
    except StoreUnavailable as exc:
        log.warning("store: %s", exc)


async def _read_left_state(term: Term) -> _LeftState:
    """Every record a predecessor left, read again until it can be, for at most
    a lease; then the term steps aside (the lease itself holds as long as the
    state bucket does, and the results bucket may be what fails)."""
    try:
        return await until_stored(
            partial(_LeftState.read, term.store), for_s=term.config.leader_lease_s
        )
    except StoreUnavailable as exc:
        raise SteppedAside(
            f"could not read the state a predecessor left for a whole lease: {exc}"
        ) from exc


async def _record_commit(
    term: Term,
    in_flight: InflightRecord,
    committed: CommittedRecord,
    recorded: UpdateResult | None,
) -> None:
    """Write what a commit left in flight may lack: the latest record, unless
    a later commit's is there, and its result. Tried again (0.2 s, doubling
    to 5 s) for a lease; still failing, the term steps aside with the update
    left in flight, for whoever leads next."""
    result = None
    if recorded is None:
        log.warning(
            "epoch=%d update=%s found in flight but committed: recording its result",
            term.epoch,
            in_flight.update_id,
        )
        result = committed_result(in_flight.update_id, committed, ran=True)
        # Ahead of the writes: stopped between them, a successor writes
        # the result again, and the trail still has the update's end.
        await term.bus.emit(term.finished(result))
    try:
        await until_stored(
            partial(_write_commit, term, committed, result), for_s=term.config.leader_lease_s
        )
    except StoreUnavailable as exc:
        raise SteppedAside(
            f"could not record the commit of {in_flight.update_id} for a whole lease: {exc}"
        ) from exc


async def _write_commit(
    term: Term, committed: CommittedRecord, result: UpdateResult | None
) -> None:
    """The latest record of a recovered commit, unless a later commit's is
    there, and its ``result`` (if it had none). Written twice, neither
    changes what the first write did."""
    if not await term.still_leading():
        raise LeadershipLost(f"epoch {term.epoch} was deposed while it recovered")
    if await term.store.latest_behind(committed.adapter):
        await term.store.write_latest(committed)
        term.book.commit(committed)
    if result is not None:
        await term.store.write_result(result)


async def _resume_everyone(
    term: Term, runner: UpdateRunner, in_flight: InflightRecord | None = None
) -> None:
    """Roll back an update in flight as far as can be without knowing what
    it loaded: resume every member it named (or, unknown, every live one)."""
    members = (
        in_flight.members
        if in_flight is not None
        else {wid: m.heartbeat.world_size for wid, m in term.membership.live().items()}
    )
    if not members:
        return  # an agent's pause lease runs out on its own
    blind = InflightRecord(
        update_id=in_flight.update_id if in_flight is not None else f"unknown-{term.epoch}",
        epoch=in_flight.epoch if in_flight is not None else 0,
        phase=Phase.PAUSE,  # nothing is withdrawn
        adapter="",
        served_name="",
        version=0,
        members=members,
    )
    error = await runner.roll_back(blind)
    log.warning("epoch=%d resumed %d members: %s", term.epoch, len(members), error.message)


async def _roll_back(term: Term, runner: UpdateRunner, in_flight: InflightRecord) -> None:
    log.warning(
        "epoch=%d update=%s found in flight (%s): rolling back",
        term.epoch,
        in_flight.update_id,
        in_flight.phase,
    )
    error = await runner.roll_back(in_flight)
    result = UpdateResult(
        update_id=in_flight.update_id,
        status=FAILED,
        adapter=in_flight.served_name,
        version=in_flight.version,
        error=error,
        path=in_flight.path or None,
    )
    await quietly(term.store.write_result(result))
    await term.bus.emit(term.finished(result))


def _records_commit_of(committed: CommittedRecord | None, in_flight: InflightRecord) -> bool:
    return committed is not None and (committed.served_name, committed.version) == (
        in_flight.served_name,
        in_flight.version,
    )


@dataclass(frozen=True)
class _LeftFlight:
    """One update in flight as a new leader finds it."""

    key: str
    in_flight: InflightRecord | None
    """None: the record does not decode (an update of unknown content)."""
    revision: int
    """The revision the record was read at: what this term takes over, and
    clears, by compare-and-set."""
    result: UpdateResult | None = None
    """Its stored result."""
    commit_point: CommittedRecord | None = None
    """The committed record of its adapter."""
    commit_point_unknown: bool = False
    """Its adapter's commit point did not decode: whether it committed is unknown."""


@dataclass(frozen=True)
class _LeftState:
    """The fleet's records as a new leader finds them."""

    committed: CommittedRecord | None
    """The latest commit: the adapter's own record (the commit point), as the
    fleet's latest record is written after it and may lag or be missing."""
    flights: tuple[_LeftFlight, ...]
    """Every update in flight."""
    corrupt: tuple[CorruptRecord, ...] = ()
    """Records that did not decode, each read as absent: the latest record (or
    its adapter's commit point: then neither is taken for committed), an
    in-flight record, an in-flight adapter's commit point."""

    @classmethod
    async def read(cls, store: FleetStore) -> _LeftState:
        """Every record, or StoreUnavailable: none is read as absent on a
        failure, but one that does not decode is (reported in ``corrupt``)."""
        corrupt: list[CorruptRecord] = []

        async def readable(read: Awaitable[_T]) -> _T | None:
            try:
                return await read
            except CorruptRecord as exc:
                _note(corrupt, exc)
                return None

        latest = await readable(store.read_committed())
        if latest is not None:
            own = await readable(store.read_committed(latest.adapter))
            if corrupt:
                latest = None  # its adapter is reset when it is next updated
            elif own is not None:
                latest = own
        flights = []
        for key in await store.inflight_keys():
            try:
                in_flight, revision = await store.read_inflight_entry(key)
            except CorruptRecord as exc:
                _note(corrupt, exc)
                flights.append(_LeftFlight(key, None, exc.revision))
                continue
            if in_flight is not None:
                flights.append(await _left_flight(store, key, in_flight, revision, corrupt))
        return cls(latest, tuple(flights), tuple(corrupt))


async def _left_flight(
    store: FleetStore,
    key: str,
    in_flight: InflightRecord,
    revision: int,
    corrupt: list[CorruptRecord],
) -> _LeftFlight:
    """What a new leader needs of one update in flight: its stored result and
    its adapter's commit point (each read as absent, and noted in
    ``corrupt``, when it does not decode)."""
    try:
        # Unsealed or garbled, it is no result (and is reported): the
        # commit point, not a stored answer, says whether it committed.
        result = await store.read_result(in_flight.update_id)
    except CorruptRecord as exc:
        _note(corrupt, exc)
        result = None
    except BadPayload as exc:
        log.warning(
            "the stored result of %s does not decode, ignored: %s", in_flight.update_id, exc
        )
        result = None
    try:
        commit_point = await store.read_committed(in_flight.adapter)
    except CorruptRecord as exc:
        _note(corrupt, exc)
        return _LeftFlight(key, in_flight, revision, result, None, commit_point_unknown=True)
    return _LeftFlight(key, in_flight, revision, result, commit_point)


def _note(corrupt: list[CorruptRecord], exc: CorruptRecord) -> None:
    if all(c.key != exc.key for c in corrupt):
        corrupt.append(exc)
