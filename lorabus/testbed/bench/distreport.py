"""The figures of the distribution series: per point (N, S) and way, and two verdicts.

Each point is a fleet of N agents and an adapter of S MB; each way of getting
the adapter to the fleet there is one :class:`DistributionResult`:

- ``bus``: pushed to the fleet's object store (``push_s``, the trainer's
  cost, not in the wall time), then an update by digest, each agent fetching it
  into its node's cache in the prepare phase;
- ``path``: the shared-directory way, an update in path mode with the digest;
- ``http-pull``: every node pulls the files from one file server and hashes
  them (``pull_s``), then a path-mode update of a copy already present
  (``update_s``); its wall time is the sum.

The verdicts: at N = 64, S = 128 MB (or the largest point measured) the bus
way's time to all-serving within 1.5x of the HTTP pull's, and its pause window
no longer than path mode's. Like the rest of the report they describe a run.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from lorabus.testbed.bench.figures import Stats, Target

BUS = "bus"
PATH = "path"
HTTP_PULL = "http-pull"
WAYS = (BUS, PATH, HTTP_PULL)

TARGET_POINT = (64, 128)
"""(N, S in MB) where the targets are set."""
BUS_OVER_PULL_MAX = 1.5

_MB = 1 << 20


class DistributionResult(msgspec.Struct, kw_only=True):
    """One way of distributing an adapter of ``adapter_mb`` MB to ``n`` agents."""

    series: str
    """``bus``, ``path`` or ``http-pull``."""
    n: int
    world_size: int
    adapter_mb: int
    nodes: int
    """Cache directories (bus) or download folders (HTTP pull) the agents share."""
    agents_per_node: int
    updates: int
    failed: int
    wall_s: Stats
    """Request to every member serving: the update's result committed (the
    HTTP pull: the pulls and checks, then that)."""
    wall_samples_s: list[float]
    phases_s: dict[str, Stats]
    """The update's phases (its ``UpdateResult``) and ``other``, the wall time
    outside them; for the HTTP pull those of its path-mode update."""
    pause_window_s: Stats | None = None
    """First engine starting to pause to last engine resumed (engine clocks)."""
    push_s: Stats | None = None
    """The bus: the push of the adapter to the object store, before the request."""
    pull_s: Stats | None = None
    """The HTTP pull: every node's download and digest check, all at once."""
    update_s: Stats | None = None
    """The HTTP pull: the path-mode update after the pulls."""
    nats_out_bytes_per_update: float
    """What the nats-server sent to its clients during an update (``/varz``
    ``out_bytes``; the push is not in it)."""
    file_server_bytes_per_update: float | None = None
    """The HTTP pull: what the trainer-side file server sent."""
    cpu_s_per_update: dict[str, float] = {}
    """CPU seconds per update, by process: coordinator, agents (every agent
    host), nats, sim (the engines), and the file server and pullers."""
    setup_s: float = 0.0
    """Starting the point's processes until the fleet was ready (shared by its ways)."""
    foreign_load: float | None = None
    """Share of all cores other processes used while the point ran (its ways
    alternate, so they share it)."""
    errors: list[str] = []


def find(
    results: Sequence[DistributionResult], series: str, n: int, adapter_mb: int
) -> DistributionResult | None:
    for result in results:
        if (result.series, result.n, result.adapter_mb) == (series, n, adapter_mb):
            return result
    return None


def _point(results: Sequence[DistributionResult]) -> tuple[int, int] | None:
    """The target's point if it was measured, else the largest one."""
    points = sorted({(r.n, r.adapter_mb) for r in results})
    if not points:
        return None
    return TARGET_POINT if TARGET_POINT in points else points[-1]


def judge_distribution(results: Sequence[DistributionResult]) -> list[Target]:
    """The two verdicts of the series (none when it did not run)."""
    point = _point(results)
    if point is None:
        return []
    n, mb = point
    bus, path, pull = (find(results, way, n, mb) for way in WAYS)
    where = f"N={n}, S={mb} MB"
    targets = []
    time_target = f"{where}: bus time to all-serving <= {BUS_OVER_PULL_MAX:g}x the HTTP pull's"
    if bus is not None and pull is not None and pull.wall_s.p50 > 0:
        ratio = bus.wall_s.p50 / pull.wall_s.p50
        pulled = (
            f" (pull {_s(pull.pull_s.p50)} + update {_s(pull.update_s.p50)})"
            if pull.pull_s and pull.update_s
            else ""
        )
        targets.append(
            Target(
                target=time_target,
                measured=f"{_s(bus.wall_s.p50)} vs {_s(pull.wall_s.p50)}{pulled}: {ratio:.2f}x",
                met=ratio <= BUS_OVER_PULL_MAX,
            )
        )
    else:
        targets.append(Target(target=time_target, measured="not measured", met=None))
    window_target = (
        f"{where}: bus pause window p50 not longer than path mode's (within its spread: "
        "at most its longest over the same updates)"
    )
    if bus and path and bus.pause_window_s and path.pause_window_s:
        others = [
            f"N={r.n} S={r.adapter_mb}: {_s(r.pause_window_s.p50)} vs {_s(base.pause_window_s.p50)}"
            for r in results
            if r.series == BUS and (r.n, r.adapter_mb) != point and r.pause_window_s
            if (base := find(results, PATH, r.n, r.adapter_mb)) and base.pause_window_s
        ]
        targets.append(
            Target(
                target=window_target,
                measured=f"{_s(bus.pause_window_s.p50)} vs {_s(path.pause_window_s.p50)} "
                f"({bus.pause_window_s.p50 / path.pause_window_s.p50:.2f}x; path mode's max "
                f"{_s(path.pause_window_s.max)})"
                + (f"; elsewhere {', '.join(others)}" if others else ""),
                met=bus.pause_window_s.p50 <= path.pause_window_s.max,
            )
        )
    else:
        targets.append(Target(target=window_target, measured="not measured", met=None))
    return targets


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1000:.1f} ms" if seconds < 0.1 else f"{seconds * 1000:.0f} ms"


_COLUMNS = (
    ("N", 5),
    ("MB", 4),
    ("nodes", 5),
    ("way", 9),
    ("p50", 7),
    ("min", 7),
    ("max", 7),
    ("push", 6),
    ("pull", 6),
    ("prep", 6),
    ("pause", 6),
    ("load", 6),
    ("resume", 6),
    ("window", 6),
    ("natsMB", 7),
    ("httpMB", 7),
)


def _cell(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _mb(count: float | None) -> str:
    return "-" if count is None else f"{count / _MB:.0f}"


def distribution_table(results: Sequence[DistributionResult]) -> list[str]:
    """The series as text lines (none when it did not run)."""
    if not results:
        return []
    per_node = results[0].agents_per_node
    lines = [
        f"distribution: an adapter of MB megabytes to N agents, {per_node} per node "
        "(times in ms, wall p50 and its min/max, phases p50; MB sent per update)",
        " ".join(f"{name:>{width}}" for name, width in _COLUMNS),
    ]
    for r in results:
        phase = {name: s.p50 for name, s in r.phases_s.items()}
        cells = [
            str(r.n),
            str(r.adapter_mb),
            str(r.nodes),
            r.series,
            _cell(r.wall_s.p50),
            _cell(r.wall_s.min),
            _cell(r.wall_s.max),
            _cell(r.push_s.p50 if r.push_s else None),
            _cell(r.pull_s.p50 if r.pull_s else None),
            _cell(phase.get("prepare")),
            _cell(phase.get("pause")),
            _cell(phase.get("load")),
            _cell(phase.get("resume")),
            _cell(r.pause_window_s.p50 if r.pause_window_s else None),
            _mb(r.nats_out_bytes_per_update),
            _mb(r.file_server_bytes_per_update),
        ]
        lines.append(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLUMNS, strict=True)))
    return lines
