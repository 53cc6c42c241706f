"""``lorabus bench --capacity C``: more tenants' adapters than engines hold.

One tiny run end to end (N = 6 workers, T = 6 tenants, keep 2, capacity 6),
on the real processes of the other series: a nats-server, the real ``lorabus
coordinator``, an agent host with null engines of capacity C. Nothing judges a
timing: every update committed, no engine's own list ever held more than C,
the placement spread within one of even, stopping a worker moved only its
adapters, the JSON holds the figures and no process is left behind. The
verdicts and the table are checked from figures made up here.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from processes import LORABUS, run_marked

from lorabus.testbed.bench import BenchReport, PlacementCase
from lorabus.testbed.bench.placementreport import (
    PlacementResult,
    judge_placement,
    placement_table,
)

RUN_DEADLINE_S = 90.0
N, T, C = 6, 6, 6

Run = tuple[int, str, Path, list[int]]


@pytest.fixture(scope="module")
def placement_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("placement")
    out = tmp / "bench.json"
    argv = [
        LORABUS, "bench", "--quick", "--capacity", str(C), "--tenants", str(T),
        "--tenant-sizes", str(N), "--keep", "2", "--agent-procs", "1",
        "--run-dir", str(tmp / "run"), "--out", str(out),
    ]  # fmt: skip
    code, text, left = run_marked(argv, RUN_DEADLINE_S)
    return code, text, out, left


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_no_engine_holds_more_than_its_capacity_and_a_stop_moves_only_its_adapters(
    placement_run: Run,
) -> None:
    code, text, out, left = placement_run
    assert code == 0, text
    report = msgspec.json.decode(out.read_bytes(), type=BenchReport)
    (result,) = report.placement
    assert (result.n, result.tenants, result.capacity) == (N, T, C)
    assert result.replicas == PlacementCase(tenants=T, capacity=C).replicas_for(N) > 0
    assert result.failed == 0 and result.committed == 2 * result.rounds * T, result.errors
    assert 0 < result.peak_held <= C
    assert result.adapters_per_worker_max - result.adapters_per_worker_min <= 1
    assert result.moved_only_its_own and len(result.moved) == result.adapters_on_stopped > 0
    assert [t.met for t in report.targets] == [True, True, True], report.targets
    assert report.settings["series"] == ["placement"]
    assert "placement series" in text
    assert left == []


def _made_up(**changes: object) -> PlacementResult:
    fields: dict[str, object] = {
        "n": 64,
        "tenants": 32,
        "keep": 2,
        "capacity": 6,
        "replicas": 3,
        "rounds": 3,
        "committed": 192,
        "failed": 0,
        "peak_held": 6,
        "adapters_per_worker_min": 1,
        "adapters_per_worker_max": 2,
        "stopped": "w063",
        "adapters_on_stopped": 2,
        "moved": ["tenant-1", "tenant-9"],
        "moved_only_its_own": True,
        "replace_s": 7.0,
        "elapsed_s": 10.0,
    }
    return PlacementResult(**{**fields, **changes})  # type: ignore[arg-type]


def test_each_verdict_fails_on_its_own_figure() -> None:
    assert [t.met for t in judge_placement([_made_up()])] == [True, True, True]
    cases = [
        (_made_up(peak_held=7), [False, True, True]),
        (_made_up(failed=1), [False, True, True]),
        (_made_up(adapters_per_worker_min=0, adapters_per_worker_max=2), [True, False, True]),
        (_made_up(moved_only_its_own=False), [True, True, False]),
        (_made_up(moved=["tenant-1"]), [True, True, False]),
    ]
    for result, met in cases:
        assert [t.met for t in judge_placement([result])] == met, result
    assert judge_placement([]) == [] and placement_table([]) == []
    row = placement_table([_made_up()])[-1].split()
    assert row == ["64", "32", "2", "6", "3", "192", "0", "6", "1-2", "2/2", "7.0"]


def test_replicas_fit_the_capacity_once_a_worker_is_stopped() -> None:
    case = PlacementCase(tenants=32, capacity=6, keep=2)
    assert case.replicas_for(64) == 3  # 32 x 3 / 63 workers: at most 2 each, 2 x 3 <= 6
    assert case.replicas_for(2) == 1
    with pytest.raises(ValueError, match="capacity"):
        PlacementCase(capacity=2, keep=2)
