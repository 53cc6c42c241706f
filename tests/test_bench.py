"""``lorabus bench`` runs every mode, writes well-formed figures, and leaves nothing behind.

A benchmark is not a test: nothing here judges a timing. The run is small
(two fleet sizes, three updates, a tiny window case) so that it stays well
under a minute; what is checked is that every mode was measured and that each
figure it should have is there and positive (CPU figures may read zero for so
few updates on a quiet machine, so those are only checked to be there).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec
import pytest
from processes import LORABUS, run_lorabus, run_marked

from lorabus.testbed.bench import BenchReport, ModeResult

RUN_DEADLINE_S = 150.0
SIZES = (8, 16)
UPDATES = 3

pytestmark = [
    pytest.mark.bench,
    pytest.mark.timeout(200),
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc"),
]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path, list[int]]:
    """One small benchmark run: exit code, stdout, the JSON file, and leftover pids."""
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "bench.json"
    argv = [
        str(LORABUS),
        "bench",
        "--quick",
        "--sizes",
        ",".join(map(str, SIZES)),
        "--updates",
        str(UPDATES),
        "--connections",
        "own,shared",
        "--window-case",
        "8:0.05:0.02",
        "--agent-procs",
        "2",
        "--sim-workers",
        "8",  # N = 16: two simulated fleet processes
        "--out",
        str(out),
    ]

    code, text, left = run_marked(argv, RUN_DEADLINE_S)
    return code, text, out, left


def _report(bench_run: tuple[int, str, Path, list[int]]) -> BenchReport:
    code, text, out, _ = bench_run
    assert code == 0, text
    return msgspec.json.decode(out.read_bytes(), type=BenchReport)


def _result(report: BenchReport, mode: str, n: int, connections: str, case: str) -> ModeResult:
    for r in report.results:
        if (r.mode, r.n, r.connections, r.case) == (mode, n, connections, case):
            return r
    raise AssertionError(f"{mode}/{connections} at N={n} ({case}) was not measured")


def _positive_stats(result: ModeResult) -> None:
    wall = result.wall_s
    assert result.updates == (UPDATES if result.case == "main" else 5)
    assert wall.count == result.updates - result.failed
    assert 0 < wall.min <= wall.p50 <= wall.p95 <= wall.max
    assert len(result.wall_samples_s) == wall.count
    assert result.phases_s, result.label
    for name, stats in result.phases_s.items():
        # Measured, and never negative. A phase may take less than the
        # phases' millisecond resolution (a resume of null engines, a verify
        # whose name the frontend listed during the load), so none is asked
        # to be above zero: timing is the bench's to report.
        assert stats.count > 0, f"{result.label}: {name}"
        assert 0 <= stats.min <= stats.p50 <= stats.max, f"{result.label}: {name}"


def test_the_run_exits_0_and_prints_one_table(bench_run: tuple[int, str, Path, list[int]]) -> None:
    code, text, _, _ = bench_run
    assert code == 0, text
    assert "lorabus-null/own" in text and "baseline" in text and "floor/shared" in text


def test_no_process_outlives_the_run(bench_run: tuple[int, str, Path, list[int]]) -> None:
    assert bench_run[3] == []


def test_every_mode_is_measured_with_every_figure(
    bench_run: tuple[int, str, Path, list[int]],
) -> None:
    report = _report(bench_run)
    assert report.unmeasured == []
    for n in SIZES:
        for connections in ("own", "shared"):
            floor = _result(report, "floor", n, connections, "main")
            _positive_stats(floor)
            assert floor.agents_cpu_s_per_update is not None
            assert floor.agents_cpu_s_per_update >= 0
            null = _result(report, "lorabus-null", n, connections, "main")
            _positive_stats(null)
        http = _result(report, "lorabus-http", n, "own", "main")
        _positive_stats(http)
        baseline = _result(report, "baseline", n, "-", "main")
        _positive_stats(baseline)
        for lorabus in (null, http):
            assert lorabus.failed == 0, lorabus.errors
            assert lorabus.central_cpu_s_per_update and lorabus.central_cpu_s_per_update > 0
            assert lorabus.central_peak_rss_mb and lorabus.central_peak_rss_mb > 0
            assert lorabus.agent_host_peak_rss_mb and lorabus.agent_host_peak_rss_mb > 0
            assert lorabus.agents_cpu_s_per_update and lorabus.agents_cpu_s_per_update > 0
            assert lorabus.nats_cpu_s_per_update is not None
            assert lorabus.central_idle_cpu_s_per_s is not None
            assert lorabus.central_rss_growth_mb_per_update is not None
            assert lorabus.pause_window_s and lorabus.pause_window_s.p50 > 0
            assert {"pause", "load", "verify", "resume"} <= set(lorabus.phases_s)
        live = _result(report, "lorabus-live", n, "own", "main")
        _positive_stats(live)
        assert live.failed == 0, live.errors
        assert live.pause_window_s is not None and live.pause_window_s.max == 0
        assert {"load", "verify"} <= set(live.phases_s) and "pause" not in live.phases_s
        assert http.single_agent_peak_rss_mb and http.single_agent_peak_rss_mb > 0
        assert http.sim_cpu_s_per_update and http.sim_cpu_s_per_update > 0
        assert baseline.central_cpu_s_per_update and baseline.central_cpu_s_per_update > 0
        assert baseline.central_peak_rss_mb and baseline.central_peak_rss_mb > 0
        assert baseline.pause_window_s and baseline.pause_window_s.p50 > 0
        assert baseline.setup_cpu_s and baseline.setup_cpu_s > 0


def test_the_window_case_sees_slow_loads(bench_run: tuple[int, str, Path, list[int]]) -> None:
    report = _report(bench_run)
    for mode, connections in (("lorabus-null", "own"), ("lorabus-http", "own"), ("baseline", "-")):
        result = _result(report, mode, 8, connections, "window")
        _positive_stats(result)
        assert result.slowest_load_s and result.slowest_load_s.min >= 0.03 - 1e-3
        ratio = result.window_over_slowest_load
        assert ratio is not None and ratio.p50 > 0


def test_ratios_and_targets_are_reported(bench_run: tuple[int, str, Path, list[int]]) -> None:
    report = _report(bench_run)
    assert [r.n for r in report.ratios] == list(SIZES)
    for ratio in report.ratios:
        for name in (
            "lorabus_over_baseline_wall_p50",
            "lorabus_over_baseline_central_cpu",
            "baseline_over_lorabus_central_cpu",
            "null_over_floor_p50",
            "null_over_floor_p50_shared",
        ):
            value = getattr(ratio, name)
            assert value is not None and value > 0, name
    assert len(report.targets) == 7 + len(SIZES)
    live = [t for t in report.targets if "live mode" in t.target]
    assert [t.target.split()[0] for t in live] == [f"N={n}" for n in sorted(SIZES)]
    assert all("bus-floor rounds" in t.target and t.met is not None for t in live)
    assert all(target.measured != "not measured" for target in report.targets)


async def test_a_secure_run_measures_every_process_on_its_own_identity_and_per_node(
    tmp_path: Path,
) -> None:
    out = tmp_path / "secure.json"
    finished = await run_lorabus(
        "bench", "--secure", "--sizes", "16", "--updates", "2", "--modes", "floor,null",
        "--connections", "node,own", "--window-case", "16:0.05:0.02", "--agent-procs", "2",
        "--run-dir", str(tmp_path / "run"), "--out", str(out),
        deadline_s=RUN_DEADLINE_S,
    )  # fmt: skip
    assert finished.returncode == 0, finished
    report = msgspec.json.decode(out.read_bytes(), type=BenchReport)
    assert report.settings["secure"] is True
    assert {(r.mode, r.connections, r.case) for r in report.results} == {
        ("floor", "node", "main"),
        ("floor", "own", "main"),
        ("lorabus-null", "node", "main"),
        ("lorabus-null", "own", "main"),
        # The window case runs in the first layout given: two node agents of 8.
        ("lorabus-null", "node", "window"),
    }
    assert all(r.failed == 0 and r.wall_s.count >= 2 for r in report.results)
    window = _result(report, "lorabus-null", 16, "node", "window")
    assert window.window_over_slowest_load is not None
    assert window.window_over_slowest_load.p50 > 0
    # The coordinator ran as its identity, on TLS; the node agents as theirs.
    logs = "".join(p.read_text() for p in (tmp_path / "run").rglob("*.log"))
    assert "connecting to NATS without credentials" not in logs


MESSAGE_COST = Path(__file__).resolve().parents[1] / "bench" / "message_cost.py"


async def test_the_message_cost_script_prints_a_row_per_gap() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(MESSAGE_COST), "--count", "50", "--gaps", "0,0.001",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        output, _ = await asyncio.wait_for(process.communicate(), RUN_DEADLINE_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    text = output.decode()
    rows = [line.split() for line in text.splitlines()[1:]]

    assert process.returncode == 0, text
    assert [float(row[0]) for row in rows] == [0.0, 1.0], text
    assert all(len(row) == 3 and min(map(float, row[1:])) >= 0 for row in rows), text
