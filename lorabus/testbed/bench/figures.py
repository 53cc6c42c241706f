"""The two shapes every figure of a run ends in: a :class:`Stats` over a
series of samples, and a :class:`Target` with its verdict.

Their own module so that the update modes' report (``report``) and the
distribution series' (``distreport``) share them without importing each other.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import msgspec


class Stats(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds (or a ratio) over a series of updates."""

    p50: float
    p95: float
    mean: float
    min: float
    max: float
    count: int


def stats_of(values: Sequence[float]) -> Stats:
    if not values:
        raise ValueError("no values to summarise")
    ordered = sorted(values)
    if len(ordered) == 1:
        p95 = ordered[0]
    else:
        p95 = statistics.quantiles(ordered, n=100, method="inclusive")[94]
    return Stats(
        p50=round(statistics.median(ordered), 6),
        p95=round(p95, 6),
        mean=round(statistics.fmean(ordered), 6),
        min=round(ordered[0], 6),
        max=round(ordered[-1], 6),
        count=len(ordered),
    )


class Target(msgspec.Struct, kw_only=True):
    target: str
    measured: str
    met: bool | None
    """None when this run did not measure it."""
