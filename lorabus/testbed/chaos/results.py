"""The invariants on requests and their results, each judged per update.

- ``rank_map``: a committed result's rank map has exactly its ok members, in
  worker-id string order, with their true world sizes, offsets 1 + the sum of
  the world sizes before, a group of 1 + the sum; one membership version per
  membership. A failed result carries no rank map.
- ``terminal_result``: every request of every tenant's loop got a terminal
  result (committed, or failed with a code other than the requester-side
  ``timeout`` / ``no_coordinator`` / ``not_leader``) within the retry bound,
  never an ``internal`` error, and asking again for the same id gives the
  same status.
- ``recovery``: once every fault is healed, an update of each adapter commits.
- ``frozen_leader_request``: an update asked with ONE client call while the
  leader was frozen got a terminal result from that call, within its timeout.

Each violation names its update and the adapter it asked for.
"""

from __future__ import annotations

from lorabus.schemas import COMMITTED, ErrorCode, UpdateResult
from lorabus.testbed.chaos.commits import ok_members
from lorabus.testbed.chaos.timeline import Timeline, UpdateRecord
from lorabus.testbed.chaos.verdict import Bounds, Violation, is_terminal

# -- rank maps -------------------------------------------------------------------


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
            Violation(
                invariant="rank_map", subject=update.update_id, detail=p, adapter=update.adapter
            )
            for p in problems
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
    ok = ok_members(result)
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


# -- terminal results --------------------------------------------------------------


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
                    adapter=update.adapter,
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
                    adapter=update.adapter,
                    detail=f"the result is for update {result.update_id}",
                )
            )
        if result.error is not None and result.error.code == ErrorCode.INTERNAL:
            violations.append(
                Violation(
                    invariant="terminal_result",
                    subject=update.update_id,
                    adapter=update.adapter,
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
                    adapter=update.adapter,
                    detail=f"answered {result.status} ({_code(result)}), but asking again "
                    f"for the same id answered {again.status}{why}",
                )
            )
    return violations


def _code(result: UpdateResult) -> str:
    return COMMITTED if result.error is None else str(result.error.code)


# -- recovery -----------------------------------------------------------------------


def check_recovery(timeline: Timeline) -> list[Violation]:
    """Once every fault is healed, an update of each adapter asked for then commits."""
    tried: dict[str, list[UpdateRecord]] = {}
    for update in timeline.updates:
        if update.update_id in timeline.recovery_ids:
            tried.setdefault(update.adapter, []).append(update)
    violations = []
    for adapter, updates in sorted(tried.items()):
        if any(u.result is not None and u.result.committed for u in updates):
            continue
        outcomes = "; ".join(f"{u.update_id}: {_outcome(u)}" for u in updates)
        violations.append(
            Violation(
                invariant="recovery",
                subject="fleet",
                detail=f"after every fault was healed no update of {adapter} committed: {outcomes}",
                adapter=adapter,
            )
        )
    return violations


def _outcome(update: UpdateRecord) -> str:
    result = update.result
    if result is None:
        return "no terminal result (" + ", ".join(update.attempts) + ")"
    if result.error is None:
        return result.status
    return f"{result.status} {result.error.code}: {result.error.message}"


# -- one call rides out a frozen leader -------------------------------------------

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
                    adapter=update.adapter,
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
                    adapter=update.adapter,
                    detail=f"one UpdateClient.update call made at {asked} "
                    f"({frozen}) returned {_code(update.result)}{took}, past its timeout of "
                    f"{timeout:.1f}s",
                )
            )
    return violations
