"""The invariants on engine pauses: ``pause_lease`` and ``unnoticed_pause``.

``pause_lease``: no engine stays paused, unattended, longer than the pause
lease plus a grace. A pause is attended from when it happens, and again from
every pause or lease renewal sent to that worker, of any update (a round of
pause-mode updates of different adapters shares one pause of each engine,
each update renewing its own hold: the pause may last as long as the round's
longest update), and from the end of every fault that kept its agent from
acting; time inside such a fault does not count. A violation names the
updates, and their adapters, whose pauses or renewals reached the worker.

``unnoticed_pause``: no engine is paused while its agent reports it running
for more than ``UNNOTICED_PAUSE_S``.
"""

from __future__ import annotations

import math

from lorabus.testbed.chaos.timeline import BLOCKING, ENGINE_LATENCY, Timeline
from lorabus.testbed.chaos.verdict import Bounds, Violation

UNNOTICED_PAUSE_S = 1.0


def check_unnoticed_pauses(timeline: Timeline) -> list[Violation]:
    return [
        Violation(invariant="unnoticed_pause", subject=worker_id, detail=detail)
        for worker_id, detail in timeline.unnoticed_pauses(UNNOTICED_PAUSE_S)
    ]


def check_pause_leases(timeline: Timeline, bounds: Bounds) -> list[Violation]:
    end_of_run = timeline.ended_at if timeline.ended_at is not None else math.inf
    adapters = timeline.adapters_of_updates()
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
                holders = _holders(timeline, worker_id, span.start - bounds.pause_lease_s, end)
                named = sorted({adapters[u] for u in holders if u in adapters})
                held = (
                    "; paused for " + ", ".join(f"{u} ({adapters.get(u, '?')})" for u in holders)
                    if holders
                    else ""
                )
                violations.append(
                    Violation(
                        invariant="pause_lease",
                        subject=worker_id,
                        detail=f"engine paused at {timeline.at(span.start)} {still} until "
                        f"{timeline.at(end)}; it went {length:.2f}s unattended, from {why} "
                        f"({timeline.at(since)}) to {until} ({timeline.at(since + length)}), "
                        f"over the bound of {limit:.2f}s (lease {bounds.pause_lease_s:.1f}s "
                        f"+ grace {bounds.grace_s:.1f}s + resume latency {allowance:.1f}s)" + held,
                        adapter=",".join(named),
                    )
                )
    return violations


def _holders(timeline: Timeline, worker_id: str, since: float, end: float) -> list[str]:
    """The updates whose pause or renewal reached the worker from ``since``
    (a lease before the pause) to its end: those it was paused for."""
    commands = timeline.lease_commands.get(worker_id, [])
    return list(dict.fromkeys(c.update_id for c in commands if since <= c.at < end))


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
