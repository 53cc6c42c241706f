"""``lorabus bench --series distribution`` measures the three ways of getting an
adapter to the fleet, and judges the bus against the HTTP pull and path mode.

The verdicts, the table, the settings and the adapters it writes are checked
fast, from figures made up here. The run itself (the quick series, end to end:
real nats-server, coordinator, agent hosts, file server and pullers) is in the
``bench`` tier; as in test_bench.py nothing there judges a timing, only that
every way was measured, committed and moved the bytes it should have.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from processes import LORABUS, run_marked

from lorabus.adapters.archive import check_adapter_dir
from lorabus.adapters.digest import adapter_digest
from lorabus.cli.measure import bench
from lorabus.testbed.bench import QUICK, BenchConfig, BenchReport, Stats, report_json, table
from lorabus.testbed.bench.config import DistributionCase
from lorabus.testbed.bench.distreport import (
    BUS,
    HTTP_PULL,
    PATH,
    DistributionResult,
    distribution_table,
    judge_distribution,
)
from lorabus.testbed.bench.distribution import write_sized_adapter

MB = 1 << 20


def _stats(p50: float, spread: float = 0.0) -> Stats:
    return Stats(p50=p50, p95=p50 + spread, mean=p50, min=p50 - spread, max=p50 + spread, count=3)


def _result(
    series: str, n: int, mb: int, wall: float, window: float, *, spread: float = 0.0
) -> DistributionResult:
    nodes = -(-n // 8)
    return DistributionResult(
        series=series,
        n=n,
        world_size=2 * n,
        adapter_mb=mb,
        nodes=nodes,
        agents_per_node=8,
        updates=3,
        failed=0,
        wall_s=_stats(wall),
        wall_samples_s=[wall] * 3,
        phases_s={"pause": _stats(window * 0.8), "resume": _stats(0.01)}
        | ({"prepare": _stats(wall * 0.9)} if series == BUS else {}),
        pause_window_s=_stats(window, spread),
        push_s=_stats(1.0) if series == BUS else None,
        pull_s=_stats(wall * 0.7) if series == HTTP_PULL else None,
        update_s=_stats(wall * 0.3) if series == HTTP_PULL else None,
        nats_out_bytes_per_update=float(nodes * mb * MB if series == BUS else 50_000),
        file_server_bytes_per_update=float(nodes * mb * MB) if series == HTTP_PULL else None,
    )


def _point(
    n: int, mb: int, bus: float, pull: float, *, bus_window: float = 0.2
) -> list[DistributionResult]:
    return [
        _result(BUS, n, mb, bus, bus_window),
        _result(PATH, n, mb, 0.5, 0.5, spread=0.1),
        _result(HTTP_PULL, n, mb, pull, 0.5),
    ]


def test_the_bus_is_judged_against_the_pull_and_path_mode_at_n64_s128() -> None:
    results = _point(8, 16, 9.0, 1.0) + _point(64, 128, 6.0, 4.5, bus_window=0.55)

    time_target, window_target = judge_distribution(results)

    assert time_target.target.startswith("N=64, S=128 MB: bus time to all-serving <= 1.5x")
    assert time_target.met is True and "1.33x" in time_target.measured
    assert "pull 3.15 s + update 1.35 s" in time_target.measured
    # 550 ms against path mode's 500 ms, whose own updates went up to 600 ms.
    assert window_target.met is True and "550 ms vs 500 ms" in window_target.measured
    assert "elsewhere N=8 S=16" in window_target.measured


def test_a_bus_slower_than_1_5x_the_pull_or_a_longer_window_misses() -> None:
    time_target, window_target = judge_distribution(
        _point(64, 128, 7.0, 4.5, bus_window=0.7) + _point(64, 16, 1.0, 1.0)
    )

    assert time_target.met is False and "1.56x" in time_target.measured
    assert window_target.met is False


def test_without_the_target_point_the_largest_point_measured_is_judged() -> None:
    targets = judge_distribution(_point(8, 16, 1.0, 1.0) + _point(8, 64, 2.0, 1.0))

    assert [t.target.split(":")[0] for t in targets] == ["N=8, S=64 MB"] * 2
    assert [t.met for t in targets] == [False, True]


def test_a_way_not_measured_leaves_its_verdict_open() -> None:
    bus, path, _ = _point(64, 128, 6.0, 4.5)

    targets = judge_distribution([bus, path])

    assert (targets[0].met, targets[0].measured) == (None, "not measured")
    assert targets[1].met is True


def test_no_series_no_verdicts_and_no_table() -> None:
    assert judge_distribution([]) == []
    assert distribution_table([]) == []


def test_the_table_gives_every_way_its_row_and_the_megabytes_it_moved() -> None:
    lines = distribution_table(_point(64, 128, 6.0, 4.5))

    assert lines[0].startswith("distribution: an adapter of MB megabytes to N agents, 8 per node")
    rows = {line.split()[3]: line.split() for line in lines[2:]}
    assert set(rows) == {BUS, PATH, HTTP_PULL}
    header = lines[1].split()
    bus = dict(zip(header, rows[BUS], strict=True))
    pull = dict(zip(header, rows[HTTP_PULL], strict=True))
    assert (bus["p50"], bus["push"], bus["natsMB"], bus["httpMB"]) == ("6000", "1000", "1024", "-")
    assert (pull["pull"], pull["natsMB"], pull["httpMB"]) == ("3150", "0", "1024")


def test_a_report_of_the_series_alone_prints_its_table_and_round_trips() -> None:
    results = _point(64, 128, 6.0, 4.5)
    report = BenchReport(
        started_at="2026-12-03T00:00:00+00:00",
        elapsed_s=1.0,
        machine={},
        settings={},
        results=[],
        ratios=[],
        targets=judge_distribution(results),
        distribution=results,
    )

    lines = table(report)
    decoded = msgspec.json.decode(report_json(report), type=BenchReport)

    assert lines[0].startswith("distribution:")  # no empty table of the update modes
    assert any(line.startswith("[   met] N=64, S=128 MB: bus time") for line in lines)
    assert decoded.distribution == results


def test_the_series_settings_are_checked_in_one_place() -> None:
    assert QUICK.distribution == DistributionCase(sizes=(8,), adapter_mb=(16,))
    assert DistributionCase(sizes=(64,), agents_per_node=8).nodes_for(60) == 8
    for wrong in ({"sizes": (0,)}, {"adapter_mb": ()}, {"agents_per_node": 0}, {"updates": 0}):
        with pytest.raises(ValueError):
            DistributionCase(**wrong)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="series must be among"):
        BenchConfig(series=("everything",))
    with pytest.raises(ValueError, match="plain NATS"):
        BenchConfig(series=("distribution",), secure=True, connections=("own",))


def test_the_cli_refuses_what_the_series_cannot_run() -> None:
    runner = CliRunner()

    secure = runner.invoke(bench, ["--series", "distribution", "--secure"])
    unknown = runner.invoke(bench, ["--series", "updates,nope"])
    no_nodes = runner.invoke(bench, ["--series", "distribution", "--agents-per-node", "0"])

    assert secure.exit_code == 2 and "plain NATS" in secure.output
    assert unknown.exit_code == 2 and "series must be among" in unknown.output
    assert no_nodes.exit_code == 2


def test_a_sized_adapter_is_an_adapter_of_that_size_with_fresh_content(tmp_path: Path) -> None:
    first = write_sized_adapter(tmp_path / "a", 2)
    second = write_sized_adapter(tmp_path / "b", 2)

    check_adapter_dir(first)
    assert (first / "adapter_model.safetensors").stat().st_size == 2 * MB
    assert adapter_digest(first) != adapter_digest(second)


# -- the quick series, end to end (the bench tier) ---------------------------------

RUN_DEADLINE_S = 150.0
AGENTS_PER_NODE = 4
N, S = 8, 16


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path, Path, list[int]]:
    """One quick distribution run: exit code, stdout, the JSON, its run dir, leftover pids."""
    tmp = tmp_path_factory.mktemp("distribution")
    out, run_dir = tmp / "bench.json", tmp / "run"
    argv = [
        str(LORABUS), "bench", "--quick", "--series", "distribution",
        "--agents-per-node", str(AGENTS_PER_NODE), "--run-dir", str(run_dir), "--out", str(out),
    ]  # fmt: skip

    code, text, left = run_marked(argv, RUN_DEADLINE_S)
    return code, text, out, run_dir, left


Run = tuple[int, str, Path, Path, list[int]]


def _report(quick_run: Run) -> BenchReport:
    code, text, out, _, _ = quick_run
    assert code == 0, text
    return msgspec.json.decode(out.read_bytes(), type=BenchReport)


def _way(report: BenchReport, series: str) -> DistributionResult:
    found = [r for r in report.distribution if (r.series, r.n, r.adapter_mb) == (series, N, S)]
    assert len(found) == 1, f"{series} at N={N}, S={S} MB: {report.unmeasured}"
    return found[0]


@pytest.mark.bench
@pytest.mark.timeout(200)
def test_the_quick_series_measures_every_way_and_moves_the_adapter(quick_run: Run) -> None:
    report = _report(quick_run)
    nodes = N // AGENTS_PER_NODE
    adapter_bytes = S * MB

    assert report.unmeasured == [] and report.results == []
    for series in (BUS, PATH, HTTP_PULL):
        result = _way(report, series)
        assert result.failed == 0, result.errors
        assert result.updates == QUICK.distribution.updates == result.wall_s.count
        assert result.nodes == nodes and result.world_size > 0
        assert 0 < result.wall_s.min <= result.wall_s.p50 <= result.wall_s.max
        assert result.pause_window_s is not None and result.pause_window_s.p50 > 0
        assert {"pause", "resume"} <= set(result.phases_s)
        assert result.cpu_s_per_update["agents"] > 0
    bus, path, pull = (_way(report, series) for series in (BUS, PATH, HTTP_PULL))
    assert "prepare" in bus.phases_s and bus.phases_s["prepare"].p50 > 0
    assert bus.push_s is not None and bus.push_s.p50 > 0
    # Each node fetched the adapter once; path mode moved no adapter over NATS.
    assert nodes * adapter_bytes <= bus.nats_out_bytes_per_update < 2 * nodes * adapter_bytes
    assert path.nats_out_bytes_per_update < adapter_bytes
    assert pull.file_server_bytes_per_update is not None
    assert pull.file_server_bytes_per_update >= nodes * adapter_bytes
    assert pull.pull_s is not None and pull.update_s is not None
    assert pull.wall_s.p50 >= pull.pull_s.p50


@pytest.mark.bench
@pytest.mark.timeout(200)
def test_the_quick_series_prints_its_table_and_both_verdicts(quick_run: Run) -> None:
    report = _report(quick_run)
    text = quick_run[1]

    assert "distribution: an adapter of MB megabytes" in text
    assert [t.target.split(":")[0] for t in report.targets] == [f"N={N}, S={S} MB"] * 2
    assert all(t.met is not None and t.measured != "not measured" for t in report.targets)
    assert report.settings["series"] == ["distribution"]


@pytest.mark.bench
@pytest.mark.timeout(200)
def test_the_quick_series_leaves_no_process_and_no_adapter_behind(quick_run: Run) -> None:
    _, _, _, run_dir, left = quick_run

    assert left == []
    folder = run_dir / f"distribution-n{N}"
    assert any(folder.glob("*coordinator.log"))
    assert not (folder / "nodes").exists() and not (folder / "trainer").exists()
