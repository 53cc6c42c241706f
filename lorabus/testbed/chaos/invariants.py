"""The invariants of a chaos run, judged on its timeline after the fact.

Each check is a pure function of the :class:`Timeline` and the run's bounds
and returns the violations it found, each with the details a bug report needs.

1. ``pause_lease``: no engine stays paused, unattended, longer than the pause
   lease plus a grace. A pause is attended from when it happens, and again
   from every pause or lease renewal sent to that worker and from the end of
   every fault that kept its agent from acting (SIGSTOP until SIGCONT, SIGKILL
   until the replacement started, an engine hang until it cleared); time
   inside such a fault does not count. A partition is no such fault: an agent
   cut off from the bus still resumes its engine when the lease runs out. A
   later update that pauses and resumes the engine does not excuse an
   unattended stretch before it. A latency injected into resumes is added to
   the bound.
2. ``committed_served``: when a committed result arrives, every member it
   counts as ok lists the adapter on its engine (read from the engine, not the
   agent). An engine that restarted during the update may lack it; it must
   list it within ``converge_s`` once nothing blocks its agent (nor cuts it
   off from the bus). After the run
   every engine serves the last committed adapter within ``converge_s`` of the
   faults being healed, and the coordinator reports the same one.
3. ``rank_map``: a committed result's rank map has exactly its ok members, in
   worker-id string order, with their true world sizes, offsets 1 + the sum
   of the world sizes before, a group of 1 + the sum; one membership version
   per membership. A failed result carries no rank map.
4. ``terminal_result``: every request got a terminal result (committed, or
   failed with a code other than the requester-side ``timeout`` /
   ``no_coordinator`` / ``not_leader``) within the retry bound, never an
   ``internal`` error, and asking again for the same id gives the same status.
5. ``fencing``: every ``command_refused`` for its epoch refused an older
   epoch than the one the agent had seen, and no command an agent acted on (its ack) was
   already stale when it was sent (its epoch below what that agent process had
   reported seeing before the command was seen on the bus). A handled command
   is judged by the commands it can have been (same update, type, worker and
   epoch; any epoch when the event carries none, as older agents send).
6. ``recovery``: once every fault is healed, an update commits.
7. ``crash``: no agent or coordinator process exits unless a fault killed it.
8. ``frozen_leader_request``: an update asked with ONE client call while the
   leader was frozen (SIGSTOP, a standby running) got a terminal result from
   that call, within its timeout: committed, or failed with a code of its own
   (``superseded``, ``phase_timeout``, ...), never the requester-side
   ``timeout`` / ``no_coordinator``; the call neither raised nor hung. Such a
   request is judged here and not by ``terminal_result``'s retries (its other
   rules, and every other invariant, apply to it as to any update).
9. ``unnoticed_pause``: no engine is paused while its agent reports it running
   for more than ``UNNOTICED_PAUSE_S``: an agent whose pause call got no
   answer reports the engine as maybe paused, and undoes a pause that lands
   late, until the pause's lease has run out.
10. ``store_keeps``: at every moment, every digest named by a committed or
    kept version (each adapter's commit point, a reset's kept versions, the
    update in flight and the commit it carries), or by a request of the run
    admitted and not finished, is in the fleet's object store. Sampled every
    ``store_sample_s`` during the run: the records, the store, the records
    again; a digest is missing only when the same record named it in both
    reads (or a request was in flight throughout) and the listing in between
    did not hold it (:mod:`lorabus.testbed.chaos.store_keeps`). A sample
    that cannot be read whole is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from lorabus.schemas import COMMITTED, ErrorCode, UpdateResult
from lorabus.testbed.chaos.store_keeps import store_lapses
from lorabus.testbed.chaos.timeline import (
    BLOCKING,
    ENGINE_LATENCY,
    ENGINE_RESTART,
    UNREACHABLE,
    Timeline,
    UpdateRecord,
)

UNANSWERED = frozenset({ErrorCode.TIMEOUT, ErrorCode.NO_COORDINATOR, ErrorCode.NOT_LEADER})
"""Failed results that only say the requester heard nothing final: ask again."""

INVARIANTS = (
    "pause_lease",
    "committed_served",
    "rank_map",
    "terminal_result",
    "fencing",
    "recovery",
    "crash",
    "frozen_leader_request",
    "unnoticed_pause",
    "store_keeps",
)
UNNOTICED_PAUSE_S = 1.0


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    invariant: str
    subject: str
    """The worker id or update id it is about."""
    detail: str

    def __str__(self) -> str:
        return f"VIOLATION {self.invariant} [{self.subject}]: {self.detail}"


@dataclass(frozen=True)
class Bounds:
    pause_lease_s: float
    grace_s: float
    """Added to the pause lease: the agent may first finish the command it is
    running (up to a phase timeout) before its own resume goes out."""
    converge_s: float
    """How long an engine may take to (re)load the committed adapter."""
    quorum_all: bool = True


def is_terminal(result: UpdateResult) -> bool:
    return result.committed or result.error is None or result.error.code not in UNANSWERED


def check_all(timeline: Timeline, bounds: Bounds) -> list[Violation]:
    return [
        *check_pause_leases(timeline, bounds),
        *check_committed_served(timeline, bounds),
        *check_final_state(timeline, bounds),
        *check_rank_maps(timeline, bounds),
        *check_terminal_results(timeline),
        *check_fencing(timeline),
        *check_recovery(timeline),
        *check_crashes(timeline),
        *check_one_call_requests(timeline),
        *check_unnoticed_pauses(timeline),
        *check_store_keeps(timeline),
    ]


def check_unnoticed_pauses(timeline: Timeline) -> list[Violation]:
    return [
        Violation(invariant="unnoticed_pause", subject=worker_id, detail=detail)
        for worker_id, detail in timeline.unnoticed_pauses(UNNOTICED_PAUSE_S)
    ]


def check_store_keeps(timeline: Timeline) -> list[Violation]:
    return [
        Violation(invariant="store_keeps", subject=digest, detail=detail)
        for digest, detail in store_lapses(timeline)
    ]


# -- 1. pause leases -----------------------------------------------------------


def check_pause_leases(timeline: Timeline, bounds: Bounds) -> list[Violation]:
    end_of_run = timeline.ended_at if timeline.ended_at is not None else math.inf
    violations = []
    for worker_id, spans in sorted(timeline.pauses.items()):
        for span in spans:
            end = span.end if span.end is not None else end_of_run
            stretch = _longest_unattended(timeline, worker_id, span.start, end)
            if stretch is None:
                continue
            length, since, why, until = stretch
            until = until or ("its resume" if span.end is not None else "the end of the run")
            allowance = max(
                (
                    w.latency_s.get("resume", 0.0)
                    for w in timeline.windows_of(worker_id, {ENGINE_LATENCY})
                    if w.overlaps(span.start, end)
                ),
                default=0.0,
            )
            limit = bounds.pause_lease_s + bounds.grace_s + allowance
            if length > limit:
                still = "is still paused" if span.end is None else "stayed paused"
                violations.append(
                    Violation(
                        invariant="pause_lease",
                        subject=worker_id,
                        detail=f"engine paused at {timeline.at(span.start)} {still} until "
                        f"{timeline.at(end)}; it went {length:.2f}s unattended, from {why} "
                        f"({timeline.at(since)}) to {until} ({timeline.at(since + length)}), "
                        f"over the bound of {limit:.2f}s (lease {bounds.pause_lease_s:.1f}s "
                        f"+ grace {bounds.grace_s:.1f}s + resume latency {allowance:.1f}s)",
                    )
                )
    return violations


def _longest_unattended(
    timeline: Timeline, worker_id: str, start: float, end: float
) -> tuple[float, float, str, str] | None:
    """The longest stretch of a pause [start, end) with nothing keeping it legitimate:
    (length, from, what started it, what ended it).

    A pause or lease renewal sent to the worker starts its lease over; while a
    blocking fault holds, its agent cannot act, and its lease starts over when
    the fault clears.
    """
    blocks = [
        (w.start, end if w.end is None else w.end, w.kind)
        for w in timeline.windows_of(worker_id, BLOCKING)
        if w.overlaps(start, end)
    ]
    resets = [(start, "the pause")]
    resets += [
        (c.at, "a pause or lease renewal sent to it")
        for c in timeline.lease_commands.get(worker_id, [])
        if start < c.at < end
    ]
    resets += [(b_end, f"the end of its {kind} fault") for _, b_end, kind in blocks if b_end < end]
    resets.sort()
    longest: tuple[float, float, str, str] | None = None
    for index, (since, why) in enumerate(resets):
        until, what = end, ""
        if index + 1 < len(resets):
            until, what = resets[index + 1][0], "the next lease reset"
        if any(b_start <= since < b_end for b_start, b_end, _ in blocks):
            continue  # inside a blocking fault: nothing to count until it clears
        for b_start, _, kind in blocks:
            if since < b_start < until:
                until, what = b_start, f"its {kind} fault"
        length = until - since
        if longest is None or length > longest[0]:
            longest = (length, since, why, what)
    return longest


# -- 2. committed adapters are served --------------------------------------------


def _ok_members(result: UpdateResult) -> list[str]:
    if "serving_workers" in result.trimmed:
        # Left out so the result fits one message: the rank map names them.
        entries = result.rank_map.entries if result.rank_map is not None else []
        return sorted(entry.worker_id for entry in entries)
    return sorted(w for w, outcome in result.workers.items() if outcome.ok)


def _committed(timeline: Timeline) -> list[UpdateRecord]:
    done = [
        u
        for u in timeline.updates
        if u.result is not None and u.result.committed and u.answered_at is not None
    ]
    return sorted(done, key=lambda u: u.answered_at or 0.0)


def _unblocked_after(timeline: Timeline, worker_id: str, start: float, converge_s: float) -> float:
    """When, from ``start`` on, the agent of ``worker_id`` has had ``converge_s``
    free of blocking faults to begin with (inf while a fault still holds)."""
    base = start
    for window in sorted(timeline.windows_of(worker_id, UNREACHABLE), key=lambda w: w.start):
        if window.start > base + converge_s:
            break
        if window.end is None:
            return math.inf
        base = max(base, window.end)
    return base


def check_committed_served(timeline: Timeline, bounds: Bounds) -> list[Violation]:
    violations = []
    committed = _committed(timeline)
    end_of_run = timeline.ended_at if timeline.ended_at is not None else math.inf
    for index, update in enumerate(committed):
        result, answered = update.result, update.answered_at
        assert result is not None and answered is not None
        for worker_id in _ok_members(result):
            if result.adapter in timeline.adapters_at(worker_id, answered):
                continue
            restarts = [
                w.start
                for w in timeline.windows_of(worker_id, {ENGINE_RESTART})
                if update.requested_at <= w.start <= answered
            ]
            held = sorted(timeline.adapters_at(worker_id, answered))
            if not restarts:
                violations.append(
                    Violation(
                        invariant="committed_served",
                        subject=worker_id,
                        detail=f"update {update.update_id} committed {result.adapter} at "
                        f"{timeline.at(answered)} counting {worker_id} ok, but its engine lists "
                        f"{held} (no engine restart excuses it)",
                    )
                )
                continue
            deadline = (
                _unblocked_after(timeline, worker_id, max(restarts), bounds.converge_s)
                + bounds.converge_s
            )
            listed = timeline.first_listed(worker_id, result.adapter, answered)
            if listed is not None and listed <= deadline:
                continue
            later = [
                u
                for u in committed[index + 1 :]
                if u.answered_at is not None
                and u.answered_at <= deadline
                and u.result is not None
                and worker_id in _ok_members(u.result)
            ]
            if later or deadline >= end_of_run:
                continue  # served a newer commit, or judged by the final check
            violations.append(
                Violation(
                    invariant="committed_served",
                    subject=worker_id,
                    detail=f"engine restarted at {timeline.at(max(restarts))} during update "
                    f"{update.update_id}; {result.adapter} was not back on it by "
                    f"{timeline.at(deadline)} (converge bound {bounds.converge_s:.1f}s once its "
                    f"agent could act); first listed "
                    + ("never" if listed is None else f"at {timeline.at(listed)}"),
                )
            )
    return violations


def check_final_state(timeline: Timeline, bounds: Bounds) -> list[Violation]:
    """After every fault is healed, engines converge to the last commit."""
    if timeline.healed_at is None:
        return []
    committed = _committed(timeline)
    if not committed:
        return []
    last = committed[-1]
    assert last.result is not None
    name = last.result.adapter
    deadline = timeline.healed_at + bounds.converge_s
    violations = []
    for worker_id in sorted(timeline.world_sizes):
        listed = timeline.first_listed(worker_id, name, timeline.healed_at)
        if listed is None or listed > deadline:
            held = sorted(timeline.adapters_at(worker_id, deadline))
            violations.append(
                Violation(
                    invariant="committed_served",
                    subject=worker_id,
                    detail=f"{bounds.converge_s:.1f}s after every fault was healed its engine "
                    f"lists {held}, not the last committed {name} "
                    f"(update {last.update_id})",
                )
            )
    reported = timeline.final_committed
    if reported is not None and reported != name:
        violations.append(
            Violation(
                invariant="committed_served",
                subject="coordinator",
                detail=f"the coordinator reports {reported} as committed, but the last "
                f"committed result was {name} (update {last.update_id})",
            )
        )
    return violations


# -- 3. rank maps ----------------------------------------------------------------


def check_rank_maps(timeline: Timeline, bounds: Bounds) -> list[Violation]:
    violations: list[Violation] = []
    versions: dict[tuple[tuple[str, int], ...], str] = {}
    owners: dict[str, tuple[tuple[str, int], ...]] = {}
    for update in timeline.updates:
        result = update.result
        if result is None:
            continue
        problems = _rank_map_problems(result, timeline.world_sizes, bounds.quorum_all)
        if result.rank_map is not None and not problems:
            membership = tuple((e.worker_id, e.world_size) for e in result.rank_map.entries)
            version = result.rank_map.membership_version
            if versions.setdefault(membership, version) != version:
                problems.append(
                    f"membership version {version}, but the same membership had "
                    f"{versions[membership]} before"
                )
            if owners.setdefault(version, membership) != membership:
                problems.append(
                    f"membership version {version} was given to another membership "
                    f"{list(owners[version])} before"
                )
        violations.extend(
            Violation(invariant="rank_map", subject=update.update_id, detail=p) for p in problems
        )
    return violations


def _rank_map_problems(
    result: UpdateResult, world_sizes: dict[str, int], quorum_all: bool
) -> list[str]:
    rank_map = result.rank_map
    if not result.committed:
        return [] if rank_map is None else ["a failed result carries a rank map"]
    if rank_map is None:
        return ["a committed result has no rank map"]
    problems = []
    ok = _ok_members(result)
    ids = [e.worker_id for e in rank_map.entries]
    if ids != ok:
        problems.append(f"rank map entries {ids} are not the ok members {ok} in string order")
    if quorum_all and sorted(ok) != sorted(world_sizes):
        problems.append(f"committed with quorum 'all' but ok members are {ok}")
    offset = 1
    for entry in rank_map.entries:
        true_size = world_sizes.get(entry.worker_id)
        reported = result.workers.get(entry.worker_id)
        if true_size is not None and entry.world_size != true_size:
            problems.append(
                f"{entry.worker_id} has world size {entry.world_size} in the rank map, "
                f"its engine has {true_size}"
            )
        if reported is not None and reported.world_size != entry.world_size:
            problems.append(
                f"{entry.worker_id} has world size {entry.world_size} in the rank map but "
                f"{reported.world_size} in the result's workers"
            )
        if entry.rank_offset != offset:
            problems.append(
                f"{entry.worker_id} has rank offset {entry.rank_offset}, expected {offset}"
            )
        offset += entry.world_size
    if rank_map.world_size != offset:
        problems.append(f"group world size {rank_map.world_size}, expected {offset}")
    return problems


# -- 4. terminal results -----------------------------------------------------------


def check_terminal_results(timeline: Timeline) -> list[Violation]:
    violations = []
    for update in timeline.updates:
        result = update.result
        if result is None and update.one_call:
            continue  # asked once on purpose: see check_one_call_requests
        if result is None:
            violations.append(
                Violation(
                    invariant="terminal_result",
                    subject=update.update_id,
                    detail=f"no terminal result after {len(update.attempts)} attempts "
                    f"with the same update id: {', '.join(update.attempts)}",
                )
            )
            continue
        if result.update_id != update.update_id:
            violations.append(
                Violation(
                    invariant="terminal_result",
                    subject=update.update_id,
                    detail=f"the result is for update {result.update_id}",
                )
            )
        if result.error is not None and result.error.code == ErrorCode.INTERNAL:
            violations.append(
                Violation(
                    invariant="terminal_result",
                    subject=update.update_id,
                    detail=f"failed with an internal error (a bug): {result.error.message}",
                )
            )
        again = update.asked_again
        if again is not None and is_terminal(again) and again.status != result.status:
            why = f" ({again.error.code}: {again.error.message})" if again.error else ""
            violations.append(
                Violation(
                    invariant="terminal_result",
                    subject=update.update_id,
                    detail=f"answered {result.status} ({_code(result)}), but asking again "
                    f"for the same id answered {again.status}{why}",
                )
            )
    return violations


def _code(result: UpdateResult) -> str:
    return COMMITTED if result.error is None else str(result.error.code)


# -- 5. fencing -----------------------------------------------------------------------


_FENCED = "it has seen epoch"
"""How an agent words a refusal of an older epoch (agents/fencing.py); its
other refusals are of commands it cannot prove yet, such as one of an epoch
ahead of the leader record it read before a partition healed, which the
leader sends again."""


def check_fencing(timeline: Timeline) -> list[Violation]:
    violations = []
    for at, refused in timeline.refused:
        if not refused.reason.startswith(_FENCED):
            continue  # unproven (ahead of the leader record it has read): re-sent, not fenced
        if refused.epoch >= refused.epoch_seen:
            violations.append(
                Violation(
                    invariant="fencing",
                    subject=refused.worker_id,
                    detail=f"refused {refused.command} of update {refused.update_id} with "
                    f"epoch {refused.epoch} at {timeline.at(at)} although it had only seen "
                    f"epoch {refused.epoch_seen}",
                )
            )
    for at, handled in timeline.handled:
        worker_id = handled.worker_id
        since = timeline.process_start(worker_id, at)
        candidates = [
            c
            for c in timeline.commands.get((handled.update_id, str(handled.phase), worker_id), [])
            if since <= c.at <= at
        ]
        if handled.epoch > 0:
            candidates = [c for c in candidates if c.epoch == handled.epoch]
        if not candidates:
            continue  # not seen on the bus here (e.g. sent while NATS restarted)
        stale = [(c, timeline.epoch_floor(worker_id, c.at)) for c in candidates]
        if all(c.epoch < floor for c, floor in stale):
            first, floor = stale[0]
            violations.append(
                Violation(
                    invariant="fencing",
                    subject=worker_id,
                    detail=f"acted on {handled.phase} of update {handled.update_id} (handled "
                    f"at {timeline.at(at)}, ok={handled.ok}); every such command was stale when "
                    f"sent, e.g. epoch {first.epoch} at {timeline.at(first.at)} after the agent "
                    f"had reported epoch {floor}",
                )
            )
    return violations


# -- 6. recovery ---------------------------------------------------------------------


def check_recovery(timeline: Timeline) -> list[Violation]:
    if not timeline.recovery_ids:
        return []
    tried = [u for u in timeline.updates if u.update_id in timeline.recovery_ids]
    if any(u.result is not None and u.result.committed for u in tried):
        return []
    outcomes = "; ".join(f"{u.update_id}: {_outcome(u)}" for u in tried)
    return [
        Violation(
            invariant="recovery",
            subject="fleet",
            detail=f"after every fault was healed no update committed: {outcomes}",
        )
    ]


def _outcome(update: UpdateRecord) -> str:
    result = update.result
    if result is None:
        return "no terminal result (" + ", ".join(update.attempts) + ")"
    if result.error is None:
        return result.status
    return f"{result.status} {result.error.code}: {result.error.message}"


def check_crashes(timeline: Timeline) -> list[Violation]:
    return [
        Violation(invariant="crash", subject=crash.split(" ", 1)[0], detail=crash)
        for crash in timeline.crashes
    ]


# -- 8. one call rides out a frozen leader -------------------------------------------

_LATE_S = 1.0
"""How far past its own timeout a call may return (scheduling on a busy machine)."""


def check_one_call_requests(timeline: Timeline) -> list[Violation]:
    violations = []
    for update in timeline.updates:
        if update.one_call_timeout_s is None:
            continue
        timeout = update.one_call_timeout_s
        outcome = update.attempts[-1] if update.attempts else "the call never returned"
        frozen = f"leader {update.frozen_leader or '?'} frozen"
        took = "" if update.call_s is None else f" after {update.call_s:.1f}s"
        asked = timeline.at(update.requested_at)
        if update.result is None:
            violations.append(
                Violation(
                    invariant="frozen_leader_request",
                    subject=update.update_id,
                    detail=f"one UpdateClient.update call made at {asked} "
                    f"({frozen}, timeout {timeout:.1f}s) ended without a terminal result{took}: "
                    f"{outcome}",
                )
            )
        elif update.call_s is not None and update.call_s > timeout + _LATE_S:
            violations.append(
                Violation(
                    invariant="frozen_leader_request",
                    subject=update.update_id,
                    detail=f"one UpdateClient.update call made at {asked} "
                    f"({frozen}) returned {_code(update.result)}{took}, past its timeout of "
                    f"{timeout:.1f}s",
                )
            )
    return violations


def count_by_invariant(violations: Iterable[Violation]) -> dict[str, int]:
    counts = dict.fromkeys(INVARIANTS, 0)
    for violation in violations:
        counts[violation.invariant] = counts.get(violation.invariant, 0) + 1
    return counts
