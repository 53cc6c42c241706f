"""The bench's report compares the baseline with the HTTP run it has:
agents per worker if it ran them, else per node (a recorded run of
N = 4096, where only per-node agents ran with HTTP engines)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from lorabus.testbed.bench import BenchReport
from lorabus.testbed.bench.report import size_ratios

RECORDED = (
    Path(__file__).resolve().parents[1]
    / "bench"
    / "results"
    / "2026-12-05-n4096-http-per-node-secure.json"
)


def test_the_baseline_is_compared_with_per_node_agents_when_only_they_ran() -> None:
    report = msgspec.json.decode(RECORDED.read_bytes(), type=BenchReport)
    http = next(r for r in report.results if r.mode == "lorabus-http")
    base = next(r for r in report.results if r.mode == "baseline")
    assert http.connections == "node"

    (ratio,) = size_ratios(report.results)

    assert ratio.n == 4096
    assert ratio.baseline_over_lorabus_central_cpu is not None
    expected = base.central_cpu_s_per_update / http.central_cpu_s_per_update
    assert abs(ratio.baseline_over_lorabus_central_cpu - expected) < 0.01
