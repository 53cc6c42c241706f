"""The figures of the tenants series: per case (N, mode, T), and three verdicts.

Each case is T tenants, each updating an adapter of its own in a loop
against one fleet of N workers, in live or pause mode, for a timed window;
it is one :class:`TenantResult`. The verdicts, at N = 256 (or the largest
fleet measured), compare the most tenants measured with one tenant in live
mode (aggregate updates per second at least 10x, p99 at most 3x), and ask
of pause mode that each engine pauses once per round whatever T.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import msgspec

from lorabus.testbed.bench.figures import Stats, Target

LIVE = "live"
PAUSE = "pause"

TARGET_N = 256
SPEEDUP_MIN = 10.0
"""Live mode: aggregate updates/s of the most tenants over one tenant's."""
P99_GROWTH_MAX = 3.0
"""Live mode: per-update p99 of the most tenants over one tenant's."""


class TenantResult(msgspec.Struct, kw_only=True):
    """T tenants' update loops against N workers, in one mode, for one window."""

    n: int
    world_size: int
    mode: str
    """``live`` or ``pause``: the coordinator's ``--mode``."""
    tenants: int
    window_s: float
    """The timed window, as it ran."""
    layout: str = "own"
    """The agents' NATS connections: ``own`` or ``node`` (node agents of 8 workers)."""
    load_latency_s: float
    keep: int
    """The coordinator's ``--keep``: versions of each adapter the engines keep."""
    committed: int
    """Updates committed and answered inside the window."""
    failed: int
    """Updates started in the window that did not commit (or raised)."""
    drained: int
    """Updates started in the window and answered after it: timed, and counted
    in the rounds and pauses, not in ``updates_per_s``."""
    updates_per_s: float
    """``committed`` / ``window_s``: every tenant's together."""
    per_tenant_committed: list[int]
    update_s: Stats | None
    """Request to answer, over every committed update started in the window."""
    update_p99_s: float | None
    phases_s: dict[str, Stats] = {}
    """The updates' phases (their ``UpdateResult``) and ``other``, the time
    outside them (the wait for a round or a free slot is in it)."""
    rounds: int | None = None
    """Pause mode: the distinct pauses the coordinator asked for, each update
    id together with the others it shares its pause with (``shared_with``),
    read off the fleet's commands on the bus."""
    updates_per_round: float | None = None
    pause_transitions_per_worker: Stats | None = None
    """Pause mode: how many times each engine went from running to paused."""
    pauses_per_round: float | None = None
    """Pause mode: mean transitions per worker over ``rounds``; 1 when every
    engine paused once per round."""
    engine_pause_calls_per_worker: float | None = None
    """Pause mode: the engines' pause calls (a pause of a paused one included)."""
    cpu_cores: dict[str, float] = {}
    """CPU seconds per second of window, by process: coordinator, agents (every
    agent host), nats, requester (this process: the T loops and the frontend)."""
    result_bytes: int | None = None
    """The encoded size of the case's last committed result (it carries every
    worker's adapter list: N x (keep x tenants so far) names)."""
    foreign_load: float | None = None
    """Share of all cores other processes of the machine used in the window."""
    errors: list[str] = []


def percentile(values: Sequence[float], q: int) -> float:
    """The ``q``-th percentile of ``values`` (inclusive method, as ``stats_of``)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[q - 1]


def find(results: Sequence[TenantResult], n: int, mode: str, tenants: int) -> TenantResult | None:
    for result in results:
        if (result.n, result.mode, result.tenants) == (n, mode, tenants):
            return result
    return None


def judge_tenants(results: Sequence[TenantResult]) -> list[Target]:
    """The series' verdicts (none when it did not run)."""
    if not results:
        return []
    sizes = sorted({r.n for r in results})
    n = TARGET_N if TARGET_N in sizes else sizes[-1]
    return [*_judge_live(results, n), _judge_rounds(results)]


def _judge_live(results: Sequence[TenantResult], n: int) -> list[Target]:
    counts = sorted({r.tenants for r in results if r.n == n and r.mode == LIVE})
    one = find(results, n, LIVE, counts[0]) if counts else None
    most = find(results, n, LIVE, counts[-1]) if len(counts) > 1 else None
    most_t, one_t = (f"T={counts[-1]}", f"T={counts[0]}") if len(counts) > 1 else ("T", "T=1")
    speed = f"N={n} live: aggregate updates/s at {most_t} >= {SPEEDUP_MIN:g}x {one_t}'s"
    tail = f"N={n} live: per-update p99 at {most_t} <= {P99_GROWTH_MAX:g}x {one_t}'s"
    if one is None or most is None or not one.updates_per_s:
        return [Target(target=t, measured="not measured", met=None) for t in (speed, tail)]
    ratio = most.updates_per_s / one.updates_per_s
    targets = [
        Target(
            target=speed,
            measured=f"{most.updates_per_s:.1f}/s vs {one.updates_per_s:.1f}/s: {ratio:.1f}x",
            met=ratio >= SPEEDUP_MIN,
        )
    ]
    if one.update_p99_s and most.update_p99_s is not None:
        growth = most.update_p99_s / one.update_p99_s
        measured = f"{_ms(most.update_p99_s)} vs {_ms(one.update_p99_s)}: {growth:.1f}x"
        targets.append(Target(target=tail, measured=measured, met=growth <= P99_GROWTH_MAX))
    else:
        targets.append(Target(target=tail, measured="not measured", met=None))
    return targets


def _judge_rounds(results: Sequence[TenantResult]) -> Target:
    target = "pause mode: each engine pauses once per round (pauses per round = 1) whatever T"
    paused = [r for r in results if r.mode == PAUSE]
    if not paused or any(r.pauses_per_round is None for r in paused):
        return Target(target=target, measured="not measured", met=None)
    shown = ", ".join(
        f"N={r.n} T={r.tenants}: {r.pauses_per_round:.3f} ({r.updates_per_round:.1f} upd/round)"
        for r in paused
    )
    return Target(
        target=target,
        measured=shown,
        met=all(round(r.pauses_per_round or 0.0, 3) == 1 for r in paused),
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


_COLUMNS = (
    ("N", 5),
    ("mode", 5),
    ("T", 3),
    ("upd/s", 7),
    ("p50", 7),
    ("p99", 7),
    ("other", 7),
    ("commits", 7),
    ("failed", 6),
    ("rounds", 6),
    ("upd/rnd", 7),
    ("pau/rnd", 7),
    ("ctrCPU", 6),
    ("agtCPU", 6),
    ("natCPU", 6),
    ("reqCPU", 6),
)


def _cell(value: float | None, scale: float = 1000.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def tenants_table(results: Sequence[TenantResult]) -> list[str]:
    """The series as text lines (none when it did not run)."""
    if not results:
        return []
    first = results[0]
    lines = [
        f"tenants: T loops, each updating its own adapter, for {first.window_s:.0f} s per case "
        f"(null engines, loads of {first.load_latency_s * 1000:.0f} ms, agents' connections "
        f"{first.layout}; times in ms; "
        "CPU in cores)",
        " ".join(f"{name:>{width}}" for name, width in _COLUMNS),
    ]
    for r in results:
        other = r.phases_s.get("other")
        cells = [
            str(r.n),
            r.mode,
            str(r.tenants),
            f"{r.updates_per_s:.1f}",
            _cell(r.update_s.p50 if r.update_s else None),
            _cell(r.update_p99_s),
            _cell(other.p50 if other else None),
            str(r.committed),
            str(r.failed),
            "-" if r.rounds is None else str(r.rounds),
            _cell(r.updates_per_round, 1),
            _cell(r.pauses_per_round, 1, 3),
            *(_cell(r.cpu_cores.get(k), 1, 2) for k in ("coordinator", "agents", "nats")),
            _cell(r.cpu_cores.get("requester"), 1, 2),
        ]
        lines.append(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLUMNS, strict=True)))
    return lines
