"""Short seeded chaos runs: every kind of fault lands, updates commit, no invariant breaks.

Agents and coordinators run as real processes on a real nats-server, which
the run itself stops and starts again; the simulated engines run in this
process. Seed 7 schedules every kind of fault within the first 32 seconds.
The run's logs stay under the test's tmp dir, and a failure prints every
violation with its details.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lorabus.errors import NatsServerMissing
from lorabus.testbed.chaos import (
    ALL_KINDS,
    ChaosConfig,
    FaultKind,
    FleetSettings,
    build_schedule,
)
from lorabus.testbed.chaos.runner import run_chaos
from lorabus.testbed.natsserver import find_nats_server

SEED = 7
DURATION_S = 32.0
MEAN_GAP_S = 2.5
WORLD_SIZES = (2, 1, 4, 1)


def _told(lines: list[str]) -> Callable[[str], None]:
    """Keep each line of the run's story, and print it as it comes, so that a
    run stopped by the test's timeout still shows how far it got."""

    def out(line: str) -> None:
        lines.append(line)
        print(f"{time.monotonic():.1f} {line}", flush=True)

    return out


@pytest.fixture(autouse=True)
def _needs_nats_server() -> None:
    try:
        find_nats_server()
    except NatsServerMissing as missing:
        pytest.skip(f"the chaos run restarts its own nats-server: {missing}")


def test_the_seed_schedules_every_kind_of_fault() -> None:
    workers = [f"w{i:03d}" for i in range(len(WORLD_SIZES))]
    schedule = build_schedule(SEED, DURATION_S, workers, mean_gap_s=MEAN_GAP_S)
    assert {f.kind for f in schedule} == set(ALL_KINDS)


@pytest.mark.chaos
@pytest.mark.timeout(90)
async def test_a_short_chaos_run_breaks_no_invariant(tmp_path: Path) -> None:
    lines: list[str] = []
    config = ChaosConfig(
        duration_s=DURATION_S,
        seed=SEED,
        world_sizes=WORLD_SIZES,
        mean_gap_s=MEAN_GAP_S,
        run_dir=tmp_path / "run",
    )

    report = await run_chaos(config, out=_told(lines))

    story = "\n".join(lines)
    assert report.violations == [], (
        "\n".join(str(v) for v in report.violations) + f"\n\n{story}\nlogs: {report.run_dir}"
    )
    assert set(report.faults_by_kind) == {str(k) for k in ALL_KINDS}, (
        f"skipped: {report.faults_skipped}\n{story}"
    )
    assert report.committed > 0, story
    assert report.attempted == report.committed + report.failed_cleanly, story


@pytest.mark.chaos
@pytest.mark.timeout(90)
async def test_one_call_made_while_the_leader_is_frozen_gets_a_terminal_result(
    tmp_path: Path,
) -> None:
    lines: list[str] = []
    config = ChaosConfig(
        faults=2,
        seed=1,
        world_sizes=WORLD_SIZES,
        mean_gap_s=3.0,
        kinds=(FaultKind.FROZEN_LEADER_REQUEST,),
        run_dir=tmp_path / "run",
    )

    report = await run_chaos(config, out=_told(lines))

    story = "\n".join(lines)
    assert report.violations == [], (
        "\n".join(str(v) for v in report.violations) + f"\n\n{story}\nlogs: {report.run_dir}"
    )
    assert report.faults_by_kind == {"frozen_leader_request": 2}, story
    calls = report.one_call_requests
    assert calls["made"] == 2, story
    assert not any(what.startswith("unanswered") for what in calls["outcomes"]), calls
    assert calls["call_s"]["max"] <= calls["timeout_s"], calls
    assert report.violations_by_invariant["frozen_leader_request"] == 0


@pytest.mark.chaos
@pytest.mark.timeout(120)
async def test_partitions_of_agents_and_the_leader_break_no_invariant(tmp_path: Path) -> None:
    """Links cut without closing (one way or both), for agents and for the
    leader: a leader cut off loses its lease and no agent obeys it after its
    successor's epoch, no engine stays paused past its lease, every request
    gets a terminal answer, and what each process held arrives late, in
    order, once healed."""
    lines: list[str] = []
    config = ChaosConfig(
        faults=8,
        seed=2,
        world_sizes=WORLD_SIZES,
        mean_gap_s=3.0,
        kinds=(FaultKind.AGENT_PARTITION, FaultKind.LEADER_PARTITION),
        run_dir=tmp_path / "run",
    )

    report = await run_chaos(config, out=_told(lines))

    story = "\n".join(lines)
    assert report.violations == [], (
        "\n".join(str(v) for v in report.violations) + f"\n\n{story}\nlogs: {report.run_dir}"
    )
    assert set(report.faults_by_kind) == {"agent_partition", "leader_partition"}, story
    assert report.committed > 0, story
    assert report.attempted == report.committed + report.failed_cleanly, story


@pytest.mark.chaos
@pytest.mark.timeout(150)
async def test_a_cluster_run_with_nodes_cut_off_and_restarted_breaks_no_invariant(
    tmp_path: Path,
) -> None:
    """On a 3-node cluster (streams with 3 replicas): a node cut off from the
    others with its clients still on it, a node restarted, and the leader's
    own link cut. A leader on a cut-off node loses its lease to one elsewhere,
    agents there are given up on or reached again, and nothing is left paused."""
    lines: list[str] = []
    config = ChaosConfig(
        faults=8,
        seed=3,
        world_sizes=WORLD_SIZES,
        mean_gap_s=3.0,
        kinds=(FaultKind.NATS_NODE_PARTITION, FaultKind.NATS_RESTART, FaultKind.LEADER_PARTITION),
        fleet=FleetSettings(world_sizes=WORLD_SIZES, nats_nodes=3),
        run_dir=tmp_path / "run",
    )

    report = await run_chaos(config, out=_told(lines))

    story = "\n".join(lines)
    assert report.violations == [], (
        "\n".join(str(v) for v in report.violations) + f"\n\n{story}\nlogs: {report.run_dir}"
    )
    assert set(report.faults_by_kind) == {str(k) for k in config.fault_kinds()}, story
    assert report.committed > 0, story
    assert report.attempted == report.committed + report.failed_cleanly, story


@pytest.mark.chaos
@pytest.mark.timeout(120)
async def test_three_tenants_updating_at_once_break_no_invariant(tmp_path: Path) -> None:
    """Three trainers, each its own update loop on its own adapter, under one
    fault schedule: every invariant holds per adapter (a restarted agent
    included: once it says ready, its engine holds every tenant's commits)."""
    lines: list[str] = []
    config = ChaosConfig(
        duration_s=25.0,
        seed=SEED,
        world_sizes=WORLD_SIZES,
        mean_gap_s=MEAN_GAP_S,
        tenants=3,
        run_dir=tmp_path / "run",
    )

    report = await run_chaos(config, out=_told(lines))

    story = "\n".join(lines)
    assert report.violations == [], (
        "\n".join(str(v) for v in report.violations) + f"\n\n{story}\nlogs: {report.run_dir}"
    )
    assert set(report.tenants) == {"tenant-0", "tenant-1", "tenant-2"}, story
    for adapter, tenant in report.tenants.items():
        assert tenant["committed"] > 0, f"{adapter}: {tenant}\n{story}"
        assert tenant["no_terminal_result"] == 0, f"{adapter}: {tenant}\n{story}"
    assert report.faults_by_kind.get("agent_kill", 0) > 0, story
    assert report.observed["ready_after_restart"]["processes"] > 0, story


@pytest.mark.chaos
@pytest.mark.timeout(150)
async def test_node_agents_killed_stopped_and_cut_off_whole_break_no_invariant(
    tmp_path: Path,
) -> None:
    """The workers under node agents of two workers each (``lorabus agent
    --node-file``): an agent fault takes the node's process, so both its
    workers at once; engine faults still hit one worker of a node. Nothing
    stays paused, every request gets a terminal answer, and what committed
    is served once healed."""
    lines: list[str] = []
    config = ChaosConfig(
        faults=8,
        seed=3,
        world_sizes=WORLD_SIZES,
        mean_gap_s=3.0,
        kinds=(
            FaultKind.AGENT_KILL,
            FaultKind.AGENT_STOP,
            FaultKind.AGENT_PARTITION,
            FaultKind.ENGINE_ERROR,
            FaultKind.ENGINE_HANG,
        ),
        fleet=FleetSettings(world_sizes=WORLD_SIZES, workers_per_node=2),
        run_dir=tmp_path / "run",
    )

    report = await run_chaos(config, out=_told(lines))

    story = "\n".join(lines)
    assert report.violations == [], (
        "\n".join(str(v) for v in report.violations) + f"\n\n{story}\nlogs: {report.run_dir}"
    )
    # One process per node (a log per start of it), none per worker.
    logs = sorted(p.name for p in (tmp_path / "run" / "logs").iterdir())
    processes = {name.split(".")[0] for name in logs if name.startswith(("node-", "agent-"))}
    assert processes == {"node-node0", "node-node1"}, logs
    assert report.faults_by_kind.get("agent_kill", 0) > 0, story
    # A kill of a worker's agent is its node's: that node's process started again.
    for line in lines:
        if line.startswith("fault") and "agent_kill" in line:
            node = {"w000": "node0", "w001": "node0", "w002": "node1", "w003": "node1"}[
                line.split("agent_kill ")[1].split()[0]
            ]
            assert f"node-{node}.2.log" in logs, f"{line}\n{logs}"
    assert report.committed > 0, story
    assert report.attempted == report.committed + report.failed_cleanly, story
