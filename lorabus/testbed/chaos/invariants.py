"""The invariants of a chaos run, judged on its timeline after the fact.

Each check is a pure function of the :class:`Timeline` and the run's bounds
and returns the violations it found, each with the details a bug report needs
and the adapter it concerns. With several tenants (one trainer, one adapter
each), each holds per adapter. The checks live beside this registry, one
module per concern:

1. ``pause_lease`` (:mod:`.pauses`): no engine stays paused, unattended,
   longer than the pause lease plus a grace. A pause is attended from when it
   happens, and again from every pause or lease renewal sent to that worker,
   of any update (a round of pause-mode updates of different adapters shares
   one pause of each engine: it may last as long as the round's longest
   update), and from the end of every fault that kept its agent from acting
   (SIGSTOP until SIGCONT, SIGKILL until the replacement started, an engine
   hang until it cleared); time inside such a fault does not count. A
   partition is no such fault: an agent cut off from the bus still resumes
   its engine when the lease runs out. A later update that pauses and
   resumes the engine does not excuse an unattended stretch before it. A
   latency injected into resumes is added to the bound.
2. ``committed_served`` (:mod:`.serving`): when a committed result arrives,
   every member it counts as ok lists the committed served name on its
   engine (read from the engine, not the agent). An engine that restarted
   during the update may lack it; it must list it within ``converge_s`` once
   nothing blocks its agent (nor cuts it off from the bus), unless a newer
   commit of the same adapter came. After the run every engine serves each
   adapter's last committed version within ``converge_s`` of the faults
   being healed, and the coordinator reports the same one for each adapter.
3. ``rank_map`` (:mod:`.results`): a committed result's rank map has exactly
   its ok members, in worker-id string order, with their true world sizes,
   offsets 1 + the sum of the world sizes before, a group of 1 + the sum;
   one membership version per membership. A failed result carries no rank map.
4. ``terminal_result`` (:mod:`.results`): every request of every tenant got
   a terminal result (committed, or failed with a code other than the
   requester-side ``timeout`` / ``no_coordinator`` / ``not_leader``) within
   the retry bound, never an ``internal`` error, and asking again for the
   same id gives the same status.
5. ``fencing`` (:mod:`.processes`): every ``command_refused`` for its epoch
   refused an older epoch than the one the agent had seen, and no command an
   agent acted on (its ack) was already stale when it was sent.
6. ``recovery`` (:mod:`.results`): once every fault is healed, an update of
   each adapter commits.
7. ``crash`` (:mod:`.processes`): no agent or coordinator process exits
   unless a fault killed it.
8. ``frozen_leader_request`` (:mod:`.results`): an update asked with ONE
   client call while the leader was frozen (SIGSTOP, a standby running) got
   a terminal result from that call, within its timeout: committed, or
   failed with a code of its own (``superseded``, ``phase_timeout``, ...),
   never the requester-side ``timeout`` / ``no_coordinator``; the call
   neither raised nor hung. Such a request is judged here and not by
   ``terminal_result``'s retries.
9. ``unnoticed_pause`` (:mod:`.pauses`): no engine is paused while its agent
   reports it running for more than ``UNNOTICED_PAUSE_S``: an agent whose
   pause call got no answer reports the engine as maybe paused, and undoes a
   pause that lands late, until the pause's lease has run out.
10. ``store_keeps`` (:mod:`.store_keeps`): at every moment, every digest
    named by a committed or kept version (each adapter's commit point, a
    reset's kept versions, each update in flight and the commit it
    carries), or by a request of the run admitted and not finished, is in
    the fleet's object store. Sampled every ``store_sample_s`` during the
    run: the records, the store, the records again; a digest is missing only
    when the same record named it in both reads (or a request was in flight
    throughout) and the listing in between did not hold it. A sample that
    cannot be read whole is skipped.
11. ``ready_after_restart`` (:mod:`.restarts`): a worker whose heartbeat says
    ready has an engine that lists every adapter's committed version and the
    versions kept beside it, as committed before its agent process started
    (what that process's first read of the fleet's records shows), less what
    a newer update it may have read since no longer keeps. So after an agent
    or engine restart, no worker counts as ready while it lacks one.
"""

from __future__ import annotations

from collections.abc import Iterable

from lorabus.testbed.chaos.pauses import (
    UNNOTICED_PAUSE_S,
    check_pause_leases,
    check_unnoticed_pauses,
)
from lorabus.testbed.chaos.processes import check_crashes, check_fencing
from lorabus.testbed.chaos.restarts import check_ready_after_restart
from lorabus.testbed.chaos.results import (
    check_one_call_requests,
    check_rank_maps,
    check_recovery,
    check_terminal_results,
)
from lorabus.testbed.chaos.serving import check_committed_served, check_final_state
from lorabus.testbed.chaos.store_keeps import store_lapses
from lorabus.testbed.chaos.timeline import Timeline
from lorabus.testbed.chaos.verdict import UNANSWERED, Bounds, Violation, is_terminal

__all__ = [
    "INVARIANTS",
    "UNANSWERED",
    "UNNOTICED_PAUSE_S",
    "Bounds",
    "Violation",
    "check_all",
    "check_committed_served",
    "check_crashes",
    "check_fencing",
    "check_final_state",
    "check_one_call_requests",
    "check_pause_leases",
    "check_rank_maps",
    "check_ready_after_restart",
    "check_recovery",
    "check_store_keeps",
    "check_terminal_results",
    "check_unnoticed_pauses",
    "count_by_adapter",
    "count_by_invariant",
    "is_terminal",
]

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
    "ready_after_restart",
)


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
        *check_ready_after_restart(timeline),
    ]


def check_store_keeps(timeline: Timeline) -> list[Violation]:
    return [
        Violation(invariant="store_keeps", subject=digest, detail=detail, adapter=adapter)
        for digest, detail, adapter in store_lapses(timeline)
    ]


def count_by_invariant(violations: Iterable[Violation]) -> dict[str, int]:
    counts = dict.fromkeys(INVARIANTS, 0)
    for violation in violations:
        counts[violation.invariant] = counts.get(violation.invariant, 0) + 1
    return counts


def count_by_adapter(violations: Iterable[Violation]) -> dict[str, int]:
    """Violations per adapter they name (one naming several counts for each)."""
    counts: dict[str, int] = {}
    for violation in violations:
        for adapter in filter(None, violation.adapter.split(",")):
            counts[adapter] = counts.get(adapter, 0) + 1
    return dict(sorted(counts.items()))
