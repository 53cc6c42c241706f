"""``lorabus bench --series tenants``: T tenants updating their own adapters at once.

One tiny run end to end (N = 4 workers, T = 1 and 3 tenants, live and pause
mode, a short window), on the real processes of the update series: a
nats-server, the real ``lorabus coordinator`` (without its canary, to check
that ``--no-canary`` reaches it), an agent host with null engines driven by
one node agent (``--tenant-connections node``). As in the other bench
tests nothing judges a timing: every tenant committed, nothing failed, each
engine paused once per round with tenants sharing rounds, the JSON holds
the figures, and no process is left behind.
The verdicts and the table are checked from figures made up here.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from processes import LORABUS, run_marked

from lorabus.testbed.bench import BenchReport, Stats, TenantResult
from lorabus.testbed.bench.tenantsreport import judge_tenants, tenants_table

RUN_DEADLINE_S = 60.0
N = 4
TENANTS = (1, 3)
MODES = ("live", "pause")

Run = tuple[int, str, Path, list[int]]


@pytest.fixture(scope="module")
def tenants_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One tiny tenants run: exit code, its output, the JSON, leftover pids."""
    tmp = tmp_path_factory.mktemp("tenants")
    out = tmp / "bench.json"
    argv = [
        LORABUS, "bench", "--quick", "--series", "tenants",
        "--tenants", ",".join(map(str, TENANTS)), "--tenant-sizes", str(N),
        "--tenant-modes", ",".join(MODES), "--tenant-seconds", "1.5",
        "--agent-procs", "1", "--run-dir", str(tmp / "run"), "--out", str(out),
        "--tenant-connections", "node", "--no-canary",
    ]  # fmt: skip

    code, text, left = run_marked(argv, RUN_DEADLINE_S)
    return code, text, out, left


def _report(tenants_run: Run) -> BenchReport:
    code, text, out, _ = tenants_run
    assert code == 0, text
    return msgspec.json.decode(out.read_bytes(), type=BenchReport)


def _case(report: BenchReport, mode: str, tenants: int) -> TenantResult:
    found = [r for r in report.tenants if (r.n, r.mode, r.tenants) == (N, mode, tenants)]
    assert len(found) == 1, f"N={N} {mode} T={tenants}: {report.unmeasured}"
    return found[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_every_tenant_commits_in_both_modes_and_nothing_fails(tenants_run: Run) -> None:
    report = _report(tenants_run)

    assert report.unmeasured == [] and report.results == [] and report.distribution == []
    for mode in MODES:
        for tenants in TENANTS:
            case = _case(report, mode, tenants)
            assert case.failed == 0 and case.errors == []
            assert len(case.per_tenant_committed) == tenants
            assert all(count > 0 for count in case.per_tenant_committed), case
            assert case.committed == sum(case.per_tenant_committed)
            assert case.updates_per_s > 0 and case.world_size > 0
            assert case.update_s is not None and case.update_s.count >= case.committed
            assert case.update_p99_s is not None and case.update_p99_s >= case.update_s.p50
            assert {"coordinator", "agents", "nats", "requester"} <= set(case.cpu_cores)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_run_takes_the_layout_and_the_canary_it_is_given(tenants_run: Run) -> None:
    report = _report(tenants_run)

    for mode in MODES:
        for tenants in TENANTS:
            case = _case(report, mode, tenants)
            assert case.layout == "node"
            assert "load" in case.phases_s and "canary" not in case.phases_s, case.phases_s
    _, text, out, _ = tenants_run
    assert "agents' connections node" in text
    # What the agent hosts were started with, not what the report echoes:
    # every worker driven by a node agent.
    specs = [json.loads(p.read_text()) for p in (out.parent / "run").rglob("*host*.spec.json")]
    assert specs, "no agent host was started"
    for spec in specs:
        driven = [w for workers in spec["nodes"].values() for w in workers]
        assert driven and sorted(driven) == sorted(spec["workers"]), spec["nodes"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pause_mode_pauses_each_engine_once_per_round_that_tenants_share(
    tenants_run: Run,
) -> None:
    report = _report(tenants_run)

    for tenants in TENANTS:
        case = _case(report, "pause", tenants)
        updates = case.committed + case.drained
        transitions = case.pause_transitions_per_worker
        assert case.rounds is not None and 0 < case.rounds <= updates
        assert transitions is not None and transitions.min == transitions.max == case.rounds
        assert case.pauses_per_round == 1
        assert case.updates_per_round is not None
        assert case.updates_per_round * case.rounds == pytest.approx(updates, rel=1e-3)
    # With three tenants some rounds carried more than one update, each
    # engine pausing once for all of them.
    assert _case(report, "pause", 3).rounds < _case(report, "pause", 3).committed
    for tenants in TENANTS:
        live = _case(report, "live", tenants)
        assert live.rounds is None and live.pauses_per_round is None


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_run_prints_its_table_and_verdicts_and_leaves_nothing_behind(
    tenants_run: Run,
) -> None:
    report = _report(tenants_run)
    text, left = tenants_run[1], tenants_run[3]

    assert "tenants: T loops" in text and "pau/rnd" in text
    assert len(report.targets) == 3
    assert all(t.met is not None and t.measured != "not measured" for t in report.targets)
    assert report.settings["series"] == ["tenants"]
    assert report.settings["tenants"]["tenants"] == list(TENANTS)
    assert left == []


def _stats(p50: float) -> Stats:
    return Stats(p50=p50, p95=p50, mean=p50, min=p50, max=p50, count=10)


def _made_up(mode: str, tenants: int, per_s: float, p99: float, pauses: float) -> TenantResult:
    paused = mode == "pause"
    return TenantResult(
        n=256,
        world_size=512,
        mode=mode,
        tenants=tenants,
        window_s=20.0,
        load_latency_s=0.0,
        keep=2,
        committed=int(per_s * 20),
        failed=0,
        drained=tenants,
        updates_per_s=per_s,
        per_tenant_committed=[int(per_s * 20 / tenants)] * tenants,
        update_s=_stats(p99 / 2),
        update_p99_s=p99,
        rounds=100 if paused else None,
        updates_per_round=tenants / 2 if paused else None,
        pauses_per_round=pauses if paused else None,
    )


def test_live_mode_is_judged_at_the_most_tenants_against_one_and_pause_per_round() -> None:
    results = [
        _made_up("live", 1, 10.0, 0.1, 0),
        _made_up("live", 32, 120.0, 0.25, 0),
        _made_up("pause", 1, 5.0, 0.2, 1.0),
        _made_up("pause", 32, 20.0, 2.0, 1.0),
    ]

    speed, tail, rounds = judge_tenants(results)

    assert speed.target.startswith("N=256 live: aggregate updates/s at T=32 >= 10x T=1's")
    assert speed.met is True and "12.0x" in speed.measured
    assert tail.met is True and "2.5x" in tail.measured
    assert rounds.met is True and "N=256 T=32: 1.000" in rounds.measured
    results[1] = _made_up("live", 32, 60.0, 0.5, 0)
    results[3] = _made_up("pause", 32, 20.0, 2.0, 1.5)
    assert [t.met for t in judge_tenants(results)] == [False, False, False]
    assert judge_tenants([]) == [] and tenants_table([]) == []
    row = tenants_table(results)[2].split()
    assert row[:4] == ["256", "live", "1", "10.0"]
