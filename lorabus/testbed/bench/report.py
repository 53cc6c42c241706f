"""The figures of a benchmark run: per fleet size and mode, ratios, targets.

Every mode measured at one fleet size is one :class:`ModeResult`; the report
adds, per size, the ratios its targets are set in (lorabus over the direct-HTTP
baseline, lorabus with null engines over the bus floor) and a verdict on each
target. The distribution series, when it ran, adds its results and verdicts
(``distreport``), and so does the tenants series (``tenantsreport``). It is
printed as tables and written as JSON with ``--out``.
The verdicts describe a run; they are not assertions, and nothing fails on them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from lorabus.testbed.bench.distreport import DistributionResult, distribution_table
from lorabus.testbed.bench.figures import Stats, Target, stats_of
from lorabus.testbed.bench.placementreport import PlacementResult, placement_table
from lorabus.testbed.bench.tenantsreport import TenantResult, tenants_table

__all__ = [
    "BASELINE",
    "FLOOR",
    "HTTP",
    "LIVE",
    "NULL",
    "BenchReport",
    "ModeResult",
    "SizeRatios",
    "Stats",
    "Target",
    "find",
    "judge",
    "report_json",
    "size_ratios",
    "stats_of",
    "table",
]

FLOOR = "floor"
NULL = "lorabus-null"
HTTP = "lorabus-http"
LIVE = "lorabus-live"
BASELINE = "baseline"


class ModeResult(msgspec.Struct, kw_only=True):
    """One mode at one fleet size: ``updates`` timed updates after a warm-up."""

    mode: str
    """``floor``, ``lorabus-null``, ``lorabus-http`` or ``baseline``."""
    connections: str
    """NATS connections of the agents (or floor subscribers): ``own`` or ``shared``;
    ``-`` for the baseline."""
    case: str
    """``main``, or ``window`` for the realistic load-latency case."""
    n: int
    world_size: int
    load_latency_s: float
    load_jitter_s: float
    updates: int
    failed: int
    wall_s: Stats
    """Update as the requester sees it (lorabus: request to result, the agents
    retire old versions after it; floor: three rounds)."""
    phases_s: dict[str, Stats]
    wall_samples_s: list[float]
    """Every timed update's wall time, in order."""
    setup_s: float
    """Starting this mode's processes until the fleet is ready."""
    setup_cpu_s: float | None = None
    """The baseline's process making its N HTTP clients."""
    pause_window_s: Stats | None = None
    """First engine starting to pause to last engine resumed (engine clocks)."""
    slowest_load_s: Stats | None = None
    """The slowest single load per update, as the engines were told to take it."""
    window_over_slowest_load: Stats | None = None
    central_cpu_s_per_update: float | None = None
    """Coordinator process (lorabus) or the orchestrator process (baseline)."""
    central_peak_rss_mb: float | None = None
    central_rss_growth_mb_per_update: float | None = None
    """How the coordinator's RSS grew per timed update (what it keeps per update)."""
    central_idle_cpu_s_per_s: float | None = None
    """The coordinator between updates: following heartbeats."""
    agents_cpu_s_per_update: float | None = None
    """All agent processes together."""
    agent_hosts: int | None = None
    agents_per_host: int | None = None
    agent_host_peak_rss_mb: float | None = None
    single_agent_peak_rss_mb: float | None = None
    """One ``lorabus agent`` process (one worker), as deployed beside an engine."""
    nats_cpu_s_per_update: float | None = None
    sim_cpu_s_per_update: float | None = None
    heartbeat_s: float | None = None
    foreign_load: float | None = None
    """Share of all cores that other processes of the machine used during the timed
    updates: above ~0.1 the figures of this mode were disturbed."""
    errors: list[str] = []

    @property
    def label(self) -> str:
        return self.mode if self.connections == "-" else f"{self.mode}/{self.connections}"


class SizeRatios(msgspec.Struct, kw_only=True):
    n: int
    lorabus_over_baseline_wall_p50: float | None = None
    lorabus_over_baseline_central_cpu: float | None = None
    baseline_over_lorabus_central_cpu: float | None = None
    """How many times less CPU the coordinator spends than the baseline's process."""
    null_over_floor_p50: float | None = None
    """Agents and floor subscribers each with their own connection."""
    null_over_floor_p50_shared: float | None = None
    """Agents and floor subscribers sharing one connection per host process."""


class BenchReport(msgspec.Struct, kw_only=True):
    v: int = 1
    started_at: str
    elapsed_s: float
    machine: dict[str, Any]
    settings: dict[str, Any]
    results: list[ModeResult]
    ratios: list[SizeRatios]
    targets: list[Target]
    unmeasured: list[str] = []
    """Modes that could not be measured, with why."""
    notes: list[str] = []
    distribution: list[DistributionResult] = []
    """The distribution series, when it ran (``--series distribution``)."""
    tenants: list[TenantResult] = []
    """The tenants series, when it ran (``--series tenants``)."""
    placement: list[PlacementResult] = []
    """The placement series, when it ran (``--series placement``)."""


def find(
    results: Sequence[ModeResult], mode: str, n: int, connections: str = "own", case: str = "main"
) -> ModeResult | None:
    for result in results:
        if (result.mode, result.n, result.case) == (mode, n, case) and (
            mode == BASELINE or result.connections == connections
        ):
            return result
    return None


def find_http(results: Sequence[ModeResult], n: int) -> ModeResult | None:
    """HTTP engines at ``n`` with an agent per worker, else per node: what
    the baseline is compared with."""
    return find(results, HTTP, n) or find(results, HTTP, n, "node")


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 3)


def size_ratios(results: Sequence[ModeResult]) -> list[SizeRatios]:
    ratios = []
    for n in sorted({r.n for r in results if r.case == "main"}):
        http, base = find_http(results, n), find(results, BASELINE, n)
        null, floor = find(results, NULL, n), find(results, FLOOR, n)
        null_s, floor_s = find(results, NULL, n, "shared"), find(results, FLOOR, n, "shared")
        ratio = SizeRatios(n=n)
        if http and base:
            ratio.lorabus_over_baseline_wall_p50 = _ratio(http.wall_s.p50, base.wall_s.p50)
            ratio.lorabus_over_baseline_central_cpu = _ratio(
                http.central_cpu_s_per_update, base.central_cpu_s_per_update
            )
            ratio.baseline_over_lorabus_central_cpu = _ratio(
                base.central_cpu_s_per_update, http.central_cpu_s_per_update
            )
        if null and floor:
            ratio.null_over_floor_p50 = _ratio(null.wall_s.p50, floor.wall_s.p50)
        if null_s and floor_s:
            ratio.null_over_floor_p50_shared = _ratio(null_s.wall_s.p50, floor_s.wall_s.p50)
        ratios.append(ratio)
    return ratios


def _growth(
    results: Sequence[ModeResult], mode: str, figure: Callable[[ModeResult], float | None]
) -> tuple[str, float] | None:
    """The exponent k in cost ~ N^k between the two largest sizes measured."""
    points = sorted(
        (r.n, value)
        for r in results
        if r.mode == mode and r.connections in ("own", "-") and r.case == "main"
        if (value := figure(r)) is not None and value > 0
    )
    if len(points) < 2:
        return None
    (n1, v1), (n2, v2) = points[-2], points[-1]
    return f"{n1}->{n2}", math.log(v2 / v1) / math.log(n2 / n1)


def judge(results: Sequence[ModeResult], ratios: Sequence[SizeRatios]) -> list[Target]:
    """A verdict on each performance target, for the largest size measured
    (live mode's, for every size)."""
    targets: list[Target] = []
    sizes = [r.n for r in ratios]
    n = max(sizes) if sizes else 0
    by_n = {r.n: r for r in ratios}
    top = by_n.get(n)

    def add(target: str, measured: str | None, met: bool | None) -> None:
        targets.append(Target(target=target, measured=measured or "not measured", met=met))

    null, floor = find(results, NULL, n), find(results, FLOOR, n)
    if top and top.null_over_floor_p50 is not None and null and floor:
        add(
            f"N={n} null engines: lorabus p50 <= 3x the bus floor",
            f"{null.wall_s.p50 * 1000:.0f} ms vs floor {floor.wall_s.p50 * 1000:.1f} ms: "
            f"{top.null_over_floor_p50:.1f}x (shared connections: "
            f"{_x(top.null_over_floor_p50_shared)})",
            top.null_over_floor_p50 <= 3,
        )
    else:
        add(f"N={n} null engines: lorabus p50 <= 3x the bus floor", None, None)
    # Live mode's target is about fixed costs, which weigh most on small
    # fleets: it is judged at every size measured.
    live_sizes = sorted(size for size in sizes if find(results, LIVE, size) is not None)
    for size in live_sizes or [n]:
        _judge_live(find(results, LIVE, size), find(results, FLOOR, size), add)
    http, base = find_http(results, n), find(results, BASELINE, n)
    if top and http and base and top.baseline_over_lorabus_central_cpu is not None:
        add(
            f"N={n} HTTP engines: coordinator CPU/update >= 20x lower than the baseline's",
            f"{_ms(http.central_cpu_s_per_update)} vs {_ms(base.central_cpu_s_per_update)}: "
            f"{top.baseline_over_lorabus_central_cpu:.1f}x lower (agents: {http.connections})",
            top.baseline_over_lorabus_central_cpu >= 20,
        )
    else:
        add(f"N={n} HTTP engines: coordinator CPU/update >= 20x lower", None, None)
    if top and http and base and top.lorabus_over_baseline_wall_p50 is not None:
        add(
            f"N={n} HTTP engines: lorabus wall p50 <= the baseline's",
            f"{http.wall_s.p50 * 1000:.0f} ms vs {base.wall_s.p50 * 1000:.0f} ms "
            f"({top.lorabus_over_baseline_wall_p50:.2f}x; agents: {http.connections})",
            top.lorabus_over_baseline_wall_p50 <= 1,
        )
    else:
        add(f"N={n} HTTP engines: lorabus wall p50 <= the baseline's", None, None)
    # Judged on the control plane's own cost. With HTTP engines the wall time
    # is mostly the engines' (all simulated on the same 2 cores): it is shown
    # beside the baseline's, which drives the same engines, for context.
    growth = [
        ("lorabus-null wall p50", _growth(results, NULL, lambda r: r.wall_s.p50)),
        (
            "coordinator CPU/update",
            _growth(results, HTTP, lambda r: r.central_cpu_s_per_update),
        ),
    ]
    measured = [(name, g) for name, g in growth if g is not None]
    context = [
        (name, g)
        for name, g in (
            ("lorabus-http wall p50", _growth(results, HTTP, lambda r: r.wall_s.p50)),
            ("baseline wall p50", _growth(results, BASELINE, lambda r: r.wall_s.p50)),
        )
        if g is not None
    ]
    shown = "; ".join(f"{name} k={g[1]:.2f} ({g[0]})" for name, g in measured)
    if context:
        shown += (
            " [not judged, the engines' share: "
            + "; ".join(f"{name} k={g[1]:.2f}" for name, g in context)
            + "]"
        )
    add(
        "cost grows linearly in N (exponent k in cost ~ N^k at most 1.1)",
        shown if measured else None,
        all(g[1] <= 1.1 for _, g in measured) if measured else None,
    )
    windows = {
        r.mode: r for r in results if r.case == "window" and r.window_over_slowest_load is not None
    }
    null_window = windows.get(NULL)
    if null_window is not None and null_window.window_over_slowest_load is not None:
        w = null_window.window_over_slowest_load
        others = ", ".join(
            f"{mode} {r.window_over_slowest_load.p50:.2f}"
            for mode, r in windows.items()
            if mode != NULL and r.window_over_slowest_load is not None
        )
        add(
            f"N={null_window.n}, loads {null_window.load_latency_s * 1000:.0f}+-"
            f"{null_window.load_jitter_s * 1000:.0f} ms: pause window <= 1.3x the slowest load",
            f"null engines: window/slowest p50 {w.p50:.2f}, p95 {w.p95:.2f} (window p50 "
            f"{_ms(null_window.pause_window_s.p50 if null_window.pause_window_s else None)}); "
            f"p50 with co-located HTTP engines: {others or '-'}",
            w.p50 <= 1.3,
        )
    else:
        add("pause window <= 1.3x the slowest load (200+-50 ms loads)", None, None)
    coordinator = max(
        (r for r in results if r.mode in (NULL, HTTP) and r.n == n and r.central_peak_rss_mb),
        key=lambda r: r.central_peak_rss_mb or 0.0,
        default=None,
    )
    add(
        f"N={n}: coordinator peak RSS < 150 MB",
        f"{coordinator.central_peak_rss_mb:.0f} MB ({coordinator.label})" if coordinator else None,
        (coordinator.central_peak_rss_mb or 0) < 150 if coordinator else None,
    )
    single = http.single_agent_peak_rss_mb if http else None
    add(
        "one agent process < 60 MB (a `lorabus agent` process beside one engine)",
        f"{single:.0f} MB at N={n}" if single else None,
        single < 60 if single else None,
    )
    return targets


def _judge_live(
    live: ModeResult | None,
    floor: ModeResult | None,
    add: Callable[[str, str | None, bool | None], None],
) -> None:
    """Live mode pauses nothing, and what it adds to the loads is at most two
    rounds of the bare bus (the loads' own round, and the commit)."""
    target = "live mode: no pause window, wall p50 - load phase p50 <= 2 bus-floor rounds"
    load = live.phases_s.get("load") if live else None
    round_s = floor.phases_s.get("round") if floor else None
    if live is None or load is None or round_s is None or live.pause_window_s is None:
        add(target, None, None)
        return
    overhead = live.wall_s.p50 - load.p50
    window = live.pause_window_s.max
    add(
        f"N={live.n} {target}",
        f"pause window max {_ms(window)}; {_ms(live.wall_s.p50)} - {_ms(load.p50)} = "
        f"{_ms(overhead)} vs 2 x {_ms(round_s.p50)} = {_ms(2 * round_s.p50)}",
        window == 0 and overhead <= 2 * round_s.p50,
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.1f}x"


_COLUMNS = (
    ("N", 5),
    ("mode", 20),
    ("p50", 7),
    ("p95", 7),
    ("pause", 6),
    ("load", 6),
    ("verify", 6),
    ("resume", 6),
    ("other", 6),
    ("window", 7),
    ("ctrCPU", 7),
    ("ctrRSS", 6),
    ("agtCPU", 7),
    ("natsCPU", 7),
)


_DISTURBED = 0.1


def _cell(value: float | None, scale: float = 1000.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(report: BenchReport) -> list[str]:
    """The run as text lines: one table, then ratios and targets."""
    header = " ".join(f"{name:>{width}}" for name, width in _COLUMNS)
    lines = []
    if report.results:
        lines += [
            "times in ms (p50 unless named), CPU in ms per update, RSS = peak MB; "
            "ctr = coordinator or the baseline's process",
            header,
        ]
    for r in report.results:
        phase = {name: s.p50 for name, s in r.phases_s.items()}
        label = r.label if r.case == "main" else f"{r.label}*"
        cells = [
            str(r.n),
            label,
            _cell(r.wall_s.p50),
            _cell(r.wall_s.p95),
            _cell(phase.get("pause")),
            _cell(phase.get("load")),
            _cell(phase.get("verify")),
            _cell(phase.get("resume")),
            _cell(phase.get("other")),
            _cell(r.pause_window_s.p50 if r.pause_window_s else None),
            _cell(r.central_cpu_s_per_update),
            _cell(r.central_peak_rss_mb, 1, 0),
            _cell(r.agents_cpu_s_per_update),
            _cell(r.nats_cpu_s_per_update),
        ]
        lines.append(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLUMNS, strict=True)))
    if any(r.case == "window" for r in report.results):
        window = next(r for r in report.results if r.case == "window")
        lines.append(
            f"* loads of {window.load_latency_s * 1000:.0f}+-{window.load_jitter_s * 1000:.0f} ms"
        )
    lines.extend(distribution_table(report.distribution))
    lines.extend(tenants_table(report.tenants))
    lines.extend(placement_table(report.placement))
    disturbed = [
        f"{r.label} N={r.n} ({r.foreign_load:.0%})"
        for r in report.results
        if r.foreign_load is not None and r.foreign_load > _DISTURBED
    ]
    disturbed += [
        f"distribution N={r.n} S={r.adapter_mb} MB ({r.foreign_load:.0%})"
        for r in report.distribution
        if r.series == "bus" and r.foreign_load is not None and r.foreign_load > _DISTURBED
    ]
    if disturbed:
        lines.append(f"other processes used the machine during: {', '.join(disturbed)}")
    for ratio in report.ratios:
        lines.append(
            f"N={ratio.n}: lorabus/baseline wall {_x(ratio.lorabus_over_baseline_wall_p50)}, "
            f"central CPU {_x(ratio.lorabus_over_baseline_central_cpu)} "
            f"({_x(ratio.baseline_over_lorabus_central_cpu)} lower); "
            f"null/floor {_x(ratio.null_over_floor_p50)} "
            f"(shared {_x(ratio.null_over_floor_p50_shared)})"
        )
    for target in report.targets:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[target.met]
        lines.append(f"[{verdict:>6}] {target.target}: {target.measured}")
    lines.extend(f"not measured: {what}" for what in report.unmeasured)
    lines.extend(f"note: {note}" for note in report.notes)
    return lines


def report_json(report: BenchReport) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report), indent=2)
