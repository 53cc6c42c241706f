"""The invariant ``committed_served``: every member of a commit serves it, per adapter.

When a committed result arrives, every member it counts as ok (every entry
of its rank map) lists the committed served name on its engine (read from
the engine, not the agent). An engine that restarted during the update may
lack it; it must list it within ``converge_s`` once nothing blocks its agent
(nor cuts it off from the bus), unless a newer commit of the same adapter
with that member came within the bound (another adapter's commit excuses
nothing). After the run, every engine serves each adapter's last committed
version within ``converge_s`` of the faults being healed (or of that commit,
if later), and the coordinator reports the same one for each adapter.
"""

from __future__ import annotations

import math

from lorabus.testbed.chaos.commits import committed_updates, last_committed, ok_members
from lorabus.testbed.chaos.timeline import ENGINE_RESTART, UNREACHABLE, Timeline, UpdateRecord
from lorabus.testbed.chaos.verdict import Bounds, Violation


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
    committed = committed_updates(timeline)
    end_of_run = timeline.ended_at if timeline.ended_at is not None else math.inf
    for index, update in enumerate(committed):
        result, answered = update.result, update.answered_at
        assert result is not None and answered is not None
        for worker_id in ok_members(result):
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
                        adapter=update.adapter,
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
                if u.adapter == update.adapter
                and u.answered_at is not None
                and u.answered_at <= deadline
                and u.result is not None
                and worker_id in ok_members(u.result)
            ]
            if later or deadline >= end_of_run:
                continue  # served a newer commit of its adapter, or judged by the final check
            violations.append(
                Violation(
                    invariant="committed_served",
                    subject=worker_id,
                    detail=f"engine restarted at {timeline.at(max(restarts))} during update "
                    f"{update.update_id}; {result.adapter} was not back on it by "
                    f"{timeline.at(deadline)} (converge bound {bounds.converge_s:.1f}s once its "
                    f"agent could act); first listed "
                    + ("never" if listed is None else f"at {timeline.at(listed)}"),
                    adapter=update.adapter,
                )
            )
    return violations


def check_final_state(timeline: Timeline, bounds: Bounds) -> list[Violation]:
    """After every fault is healed, engines converge to each adapter's last commit."""
    if timeline.healed_at is None:
        return []
    violations = []
    lasts = last_committed(timeline)
    for adapter, last in sorted(lasts.items()):
        assert last.result is not None and last.answered_at is not None
        name = last.result.adapter
        since = max(timeline.healed_at, last.answered_at)
        deadline = since + bounds.converge_s
        for worker_id in sorted(timeline.world_sizes):
            listed = timeline.first_listed(worker_id, name, since)
            if listed is None or listed > deadline:
                held = sorted(timeline.adapters_at(worker_id, deadline))
                violations.append(
                    Violation(
                        invariant="committed_served",
                        subject=worker_id,
                        detail=f"{bounds.converge_s:.1f}s after every fault was healed its "
                        f"engine lists {held}, not the last committed {name} "
                        f"(update {last.update_id})",
                        adapter=adapter,
                    )
                )
    violations += _reported(timeline, lasts)
    return violations


def _reported(timeline: Timeline, lasts: dict[str, UpdateRecord]) -> list[Violation]:
    """The coordinator reports each adapter's last commit (with one adapter,
    as the fleet's latest commit when it was not asked for each)."""
    names = {adapter: u.result.adapter for adapter, u in lasts.items() if u.result is not None}
    by_adapter = timeline.final_adapters
    if by_adapter is None:
        if timeline.final_committed is None or len(names) != 1:
            return []
        [(adapter, name)] = names.items()
        by_adapter = {adapter: timeline.final_committed}
    violations = []
    for adapter, name in sorted(names.items()):
        reported = by_adapter.get(adapter, "(none)")
        if reported != name:
            last = lasts[adapter]
            violations.append(
                Violation(
                    invariant="committed_served",
                    subject="coordinator",
                    detail=f"the coordinator reports {reported} as committed for {adapter}, "
                    f"but the last committed result was {name} (update {last.update_id})",
                    adapter=adapter,
                )
            )
    return violations
