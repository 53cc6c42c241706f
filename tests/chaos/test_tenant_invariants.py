"""The invariants hold per adapter when several tenants update at once.

Timelines are built by hand, as in ``test_invariants.py``: three tenants'
adapters over workers ``a`` and ``b``, each rule shown on the smallest record
that breaks it for one adapter and not for the others, and the violation
must name that adapter.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lorabus.adapters.bus_paths import bus_path
from lorabus.schemas import (
    CommittedRecord,
    ErrorCode,
    ErrorInfo,
    KeptVersion,
    UpdateResult,
    WorkerOutcome,
    build_rank_map,
)
from lorabus.testbed.chaos import Bounds, Timeline, check_all
from lorabus.testbed.chaos.invariants import (
    check_committed_served,
    check_final_state,
    check_pause_leases,
    check_ready_after_restart,
    check_recovery,
    check_store_keeps,
    check_terminal_results,
)
from lorabus.testbed.chaos.quiet import QuietWindows
from lorabus.testbed.chaos.report import build_report
from lorabus.testbed.chaos.restarts import restart_coverage
from lorabus.testbed.chaos.store_watch import record_names
from lorabus.testbed.chaos.timeline import (
    ENGINE_RESTART,
    LeaseCommand,
    Notice,
    StoreSample,
    UpdateRecord,
)

SIZES = {"a": 2, "b": 1}
BOUNDS = Bounds(pause_lease_s=4.0, grace_s=8.0, converge_s=10.0)
TENANTS = ("tenant-0", "tenant-1", "tenant-2")


def served(adapter: str, version: int) -> str:
    return f"{adapter}-v{version}"


def committed(adapter: str, version: int) -> UpdateResult:
    name = served(adapter, version)
    return UpdateResult(
        update_id=f"{adapter}-{version}",
        status="committed",
        adapter=name,
        version=version,
        rank_map=build_rank_map(SIZES),
        workers={
            w: WorkerOutcome(ok=True, world_size=s, adapters=[name]) for w, s in SIZES.items()
        },
    )


def commit(
    t: Timeline,
    adapter: str,
    version: int,
    at: float,
    *,
    kept: tuple[int, ...] = (),
    lacking: str = "",
) -> UpdateRecord:
    """Update ``<adapter>-<version>``: sent at ``at``, answered committed at
    ``at + 0.5`` (both engines list it then, but the worker ``lacking``), its
    notice seen at ``at + 0.6``."""
    update_id = f"{adapter}-{version}"
    record = UpdateRecord(
        update_id=update_id,
        version=version,
        path=f"/adapters/{adapter}/step_{version}",
        requested_at=at,
        sent_at=at,
        answered_at=at + 0.5,
        attempts=["committed"],
        result=committed(adapter, version),
        asked_again=committed(adapter, version),
        adapter=adapter,
    )
    t.updates.append(record)
    t.notice_seen(
        Notice(
            at=at + 0.6,
            adapter=adapter,
            version=version,
            served_name=served(adapter, version),
            kept=frozenset(served(adapter, v) for v in kept),
            update_id=update_id,
        )
    )
    for worker_id in SIZES:
        if worker_id != lacking:
            held = t.adapters_at(worker_id, at + 0.4)
            t.engine_adapters(worker_id, held | {served(adapter, version)}, at + 0.4)
    return record


def fleet(*, lacking: str = "") -> Timeline:
    """Three tenants: tenant-0 v1 (at 1), tenant-1 v1 (at 1.1), tenant-2 v1,
    then v2 keeping v1 (at 2): every engine lists all of them (but worker
    ``lacking`` never loads tenant-1 v1)."""
    t = Timeline(world_sizes=dict(SIZES))
    for worker_id in SIZES:
        t.agent_started(worker_id, 0.0)
        t.engine_adapters(worker_id, frozenset(), 0.0)
        t.readiness(worker_id, f"{worker_id}-first", True, frozenset(), 0.5)
    commit(t, "tenant-0", 1, 1.0)
    commit(t, "tenant-1", 1, 1.1, lacking=lacking)
    commit(t, "tenant-2", 1, 1.2)
    commit(t, "tenant-2", 2, 2.0, kept=(1,))
    t.recovery_ids.update(u.update_id for u in t.updates if u.version == 1)
    t.healed_at = 3.0
    t.final_adapters = {
        "tenant-0": "tenant-0-v1",
        "tenant-1": "tenant-1-v1",
        "tenant-2": "tenant-2-v2",
    }
    t.ended_at = 30.0
    return t


def everything() -> frozenset[str]:
    return frozenset({"tenant-0-v1", "tenant-1-v1", "tenant-2-v1", "tenant-2-v2"})


def restart_agent(t: Timeline, worker_id: str, at: float, instance: str = "second") -> None:
    t.agent_started(worker_id, at)
    t.readiness(worker_id, instance, False, frozenset(), at + 0.2)


def test_a_clean_run_of_three_tenants_has_no_violations() -> None:
    t = fleet()
    restart_agent(t, "b", 5.0)
    t.readiness("b", "second", True, everything(), 5.5)

    assert check_all(t, BOUNDS) == []
    assert restart_coverage(t)["ready_heartbeats"] == 1


# -- committed_served, per adapter ---------------------------------------------------


def test_a_commit_of_one_tenant_missing_on_a_member_names_that_tenant() -> None:
    t = fleet(lacking="b")

    [violation] = check_committed_served(t, BOUNDS)

    assert (violation.invariant, violation.subject) == ("committed_served", "b")
    assert violation.adapter == "tenant-1"
    assert "update tenant-1-1 committed tenant-1-v1" in violation.detail
    assert "(tenant-1)" in str(violation)


def test_another_tenants_later_commit_excuses_no_reload() -> None:
    """b's engine restarted during tenant-1's update and never got tenant-1-v1
    back; tenant-0's next commit, which counts b, says nothing of tenant-1."""
    t = fleet(lacking="b")
    t.instant(ENGINE_RESTART, "b", 1.45)
    commit(t, "tenant-0", 2, 5.0)

    violations = check_committed_served(t, BOUNDS)

    assert [(v.subject, v.adapter) for v in violations] == [("b", "tenant-1")]
    assert "was not back on it" in violations[0].detail


def test_after_healing_each_tenants_last_commit_is_on_every_engine() -> None:
    t = fleet()
    t.engine_adapters("a", everything() - {"tenant-2-v2"}, 2.8)

    [violation] = check_final_state(t, BOUNDS)

    assert (violation.subject, violation.adapter) == ("a", "tenant-2")
    assert "not the last committed tenant-2-v2" in violation.detail


def test_the_coordinator_must_report_each_tenants_last_commit() -> None:
    t = fleet()
    assert t.final_adapters is not None
    t.final_adapters["tenant-1"] = "tenant-1-v0"

    [violation] = check_final_state(t, BOUNDS)

    assert (violation.subject, violation.adapter) == ("coordinator", "tenant-1")


# -- ready_after_restart ------------------------------------------------------------


def test_a_restarted_agent_ready_without_a_tenants_committed_version_is_a_violation() -> None:
    t = fleet()
    t.instant(ENGINE_RESTART, "b", 4.0)
    t.engine_adapters("b", frozenset(), 4.0)
    restart_agent(t, "b", 5.0)
    reloaded = frozenset({"tenant-0-v1", "tenant-1-v1"})
    t.engine_adapters("b", reloaded, 5.3)
    for at in (5.5, 5.7):
        t.readiness("b", "second", True, reloaded, at)

    violations = check_ready_after_restart(t)

    assert sorted((v.subject, v.adapter) for v in violations) == [
        ("b", "tenant-2"),
        ("b", "tenant-2"),
    ]
    details = " | ".join(v.detail for v in violations)
    assert "without tenant-2-v2 (committed by update tenant-2-2" in details
    assert "without tenant-2-v1 (kept beside tenant-2-v2" in details
    assert "2 ready heartbeats of that process lacked it" in details
    assert all(v.invariant == "ready_after_restart" for v in check_all(t, BOUNDS))


def test_a_commit_that_lands_after_the_agent_started_is_not_held_against_it() -> None:
    """The agent started at 5; tenant-0 v2 committed at 6 (the agent may not
    have its notice yet) and let nothing go: its ready heartbeat without it
    breaks nothing, the commits known before the agent started are there."""
    t = fleet()
    restart_agent(t, "b", 5.0)
    commit(t, "tenant-0", 2, 5.8, kept=(1,))
    t.engine_adapters("b", everything(), 6.35)  # b's engine never loaded tenant-0-v2
    t.readiness("b", "second", True, everything(), 6.5)

    assert check_ready_after_restart(t) == []


def test_a_version_a_newer_update_may_have_let_go_is_not_required() -> None:
    """tenant-2 v3 was sent before the heartbeat and keeps only v2: an agent
    that read its commit point unloads v1 and may say ready without it."""
    t = fleet()
    restart_agent(t, "b", 5.0)
    commit(t, "tenant-2", 3, 5.5, kept=(2,))
    lean = everything() - {"tenant-2-v1"}
    t.engine_adapters("b", lean | {"tenant-2-v3"}, 5.9)
    t.readiness("b", "second", True, lean | {"tenant-2-v3"}, 6.0)
    assert check_ready_after_restart(t) == []

    t.engine_adapters("b", lean - {"tenant-2-v2"} | {"tenant-2-v3"}, 6.1)  # kept by v3
    t.readiness("b", "second", True, lean - {"tenant-2-v2"} | {"tenant-2-v3"}, 6.2)
    [violation] = check_ready_after_restart(t)
    assert violation.adapter == "tenant-2" and "without tenant-2-v2" in violation.detail


def test_a_report_read_back_before_an_engine_restart_is_not_held_against_the_engine() -> None:
    """b's engine restarts at 6 under the restarted agent; a heartbeat that
    still lists what the engine lost was read back before the restart. Once
    the agent's own list lacks it and it says ready all the same, it breaks."""
    t = fleet()
    restart_agent(t, "b", 5.0)
    t.readiness("b", "second", True, everything(), 5.5)
    t.instant(ENGINE_RESTART, "b", 6.0)
    t.engine_adapters("b", frozenset(), 6.0)
    t.readiness("b", "second", True, everything(), 6.1)
    assert check_ready_after_restart(t) == []

    partial = frozenset({"tenant-0-v1", "tenant-1-v1", "tenant-2-v2"})
    t.engine_adapters("b", partial, 6.3)
    t.readiness("b", "second", True, partial, 6.4)
    [violation] = check_ready_after_restart(t)
    assert (violation.subject, violation.adapter) == ("b", "tenant-2")
    assert "its engine restarted at t+6.00s" in violation.detail
    assert "without tenant-2-v1" in violation.detail


def test_heartbeats_of_the_process_before_a_restart_are_held_to_its_own_start() -> None:
    """The first agent process (started before anything was committed) is
    held to nothing, even when its heartbeat is seen after its successor
    started: it may not have heard of any commit."""
    t = fleet()
    restart_agent(t, "b", 5.0)
    t.engine_adapters("b", frozenset(), 5.05)
    t.readiness("b", "b-first", True, frozenset(), 5.1)

    assert check_ready_after_restart(t) == []


# -- pause_lease, terminal_result, recovery ---------------------------------------------


def test_a_shared_pause_lasts_as_long_as_the_rounds_longest_update() -> None:
    t = fleet()
    t.lease_command(LeaseCommand("a", 10.0, 1, "tenant-0-9"))
    t.lease_command(LeaseCommand("a", 10.0, 1, "tenant-1-9"))
    t.updates += [
        UpdateRecord("tenant-0-9", 9, "", 10.0, adapter="tenant-0"),
        UpdateRecord("tenant-1-9", 9, "", 10.0, adapter="tenant-1"),
    ]
    t.engine_paused("a", True, 10.1)
    for at in range(12, 30, 2):  # tenant-1's update renews while it runs
        t.lease_command(LeaseCommand("a", float(at), 1, "tenant-1-9"))
    t.engine_paused("a", False, 29.0)
    assert check_pause_leases(t, BOUNDS) == []

    t.pauses["a"][-1].end = 28.0 + 4.0 + 8.0 + 0.5  # its last renewal, then nothing
    [violation] = check_pause_leases(t, BOUNDS)
    assert violation.adapter == "tenant-0,tenant-1"
    assert "paused for tenant-0-9 (tenant-0), tenant-1-9 (tenant-1)" in violation.detail


def test_a_tenants_request_without_a_terminal_result_names_it() -> None:
    t = fleet()
    t.updates.append(
        UpdateRecord(
            "tenant-1-9", 9, "/x", 4.0, adapter="tenant-1", sent_at=4.0, attempts=["failed:timeout"]
        )
    )

    [violation] = check_terminal_results(t)

    assert (violation.subject, violation.adapter) == ("tenant-1-9", "tenant-1")


def test_every_tenant_must_recover() -> None:
    t = fleet()
    failed = UpdateResult(
        update_id="tenant-1-1",
        status="failed",
        adapter="tenant-1-v1",
        version=1,
        error=ErrorInfo(code=ErrorCode.QUORUM_TIMEOUT, message="quorum"),
    )
    t.updates[1].result = failed
    t.updates[1].asked_again = failed

    [violation] = check_recovery(t)

    assert violation.adapter == "tenant-1"
    assert "no update of tenant-1 committed" in violation.detail


# -- store_keeps, with several adapters ---------------------------------------------------

D1, D2, D3 = ("sha256:" + c * 64 for c in "123")


def point(adapter: str, version: int, digest: str, kept: tuple[int, str] | None) -> CommittedRecord:
    return CommittedRecord(
        adapter=adapter,
        version=version,
        path=bus_path(digest),
        served_name=served(adapter, version),
        rank_map=build_rank_map({"a": 1}),
        digest=digest,
        kept=[]
        if kept is None
        else [
            KeptVersion(
                version=kept[0], served_name=served(adapter, kept[0]), path=bus_path(kept[1])
            )
        ],
    )


def test_a_digest_one_tenant_keeps_is_missing_names_that_tenant() -> None:
    records = record_names(
        {"tenant-0": point("tenant-0", 2, D1, None), "tenant-1": point("tenant-1", 5, D2, (4, D3))},
        {},
    )
    t = Timeline()
    t.store_samples.append(
        StoreSample(
            began=10.0,
            listed_from=10.1,
            listed_to=10.2,
            ended=10.3,
            before=records,
            after=records,
            stored=frozenset({D1, D2}),
        )
    )

    [violation] = check_store_keeps(t)

    assert (violation.subject, violation.adapter) == (D3, "tenant-1")
    assert "tenant-1 v4, kept by the commit point of tenant-1 v5" in violation.detail


# -- the report, and the quiet windows ------------------------------------------------------


def test_the_report_counts_each_tenants_updates_and_the_violations_per_adapter() -> None:
    t = fleet()
    t.updates.append(
        UpdateRecord(
            "tenant-1-2",
            2,
            "/x",
            4.0,
            adapter="tenant-1",
            sent_at=4.0,
            answered_at=5.0,
            result=UpdateResult(
                update_id="tenant-1-2",
                status="failed",
                adapter="tenant-1-v2",
                version=2,
                error=ErrorInfo(code=ErrorCode.PHASE_TIMEOUT, message="slow"),
            ),
        )
    )
    t.engine_adapters("a", everything() - {"tenant-2-v2"}, 2.8)
    violations = check_all(t, BOUNDS)

    report = build_report(
        seed=1,
        duration_s=1.0,
        elapsed_s=1.0,
        settings={},
        timeline=t,
        schedule=[],
        injected=[],
        skipped=[],
        violations=violations,
        run_dir="",
    )

    assert report.tenants["tenant-1"] == {
        "attempted": 2,
        "committed": 1,
        "failed_by_code": {"phase_timeout": 1},
        "no_terminal_result": 0,
        "goodput": 0.5,
    }
    assert report.tenants["tenant-2"]["committed"] == 2
    assert report.violations_by_adapter == {"tenant-2": 1}
    lines = report.figure_lines()
    assert (
        "tenant tenant-1: asked 2, committed 1, failed 1 (phase_timeout 1), "
        "without a terminal result 0; goodput 50%" in lines
    )


@pytest.mark.timeout(10)
async def test_a_quiet_window_waits_for_every_step_under_way_and_holds_the_next() -> None:
    quiet = QuietWindows()
    stepping, release = asyncio.Event(), asyncio.Event()
    order: list[str] = []

    async def one_step(name: str) -> None:
        async with quiet.step():
            order.append(f"{name} starts")
            stepping.set()
            await release.wait()
            order.append(f"{name} ends")

    first = asyncio.create_task(one_step("first"))
    await stepping.wait()
    holding = asyncio.create_task(quiet.hold(0.01))
    await asyncio.sleep(0)
    second = asyncio.create_task(one_step("second"))
    await asyncio.sleep(0.05)
    assert not holding.done() and order == ["first starts"]

    release.set()
    await asyncio.gather(first, holding, second)

    assert order == ["first starts", "first ends", "second starts", "second ends"]
    assert quiet.held == 1


def test_every_tenant_writes_its_own_bytes(tmp_path: Path) -> None:
    from lorabus.testbed.chaos.adapters import _TENANT_SEED
    from lorabus.testbed.trainer import write_adapter

    one = write_adapter(tmp_path / "0", 3, with_torch=False)
    other = write_adapter(tmp_path / "1", 3, seed=_TENANT_SEED, with_torch=False)

    assert (one / "adapter_model.safetensors").read_bytes() != (
        other / "adapter_model.safetensors"
    ).read_bytes()
