"""The invariant checker finds a planted violation of each invariant, and none in a clean run.

Timelines are built by hand here: the checker is a pure function of what a run
recorded, so each rule is shown on the smallest record that breaks it.
"""

from __future__ import annotations

import msgspec
import pytest

from lorabus.schemas import (
    CommandHandled,
    CommandRefused,
    ErrorCode,
    ErrorInfo,
    Phase,
    UpdateResult,
    WorkerOutcome,
    build_rank_map,
)
from lorabus.testbed.chaos import Bounds, Timeline, check_all
from lorabus.testbed.chaos.invariants import (
    check_committed_served,
    check_fencing,
    check_final_state,
    check_one_call_requests,
    check_pause_leases,
    check_rank_maps,
    check_recovery,
    check_terminal_results,
    check_unnoticed_pauses,
)
from lorabus.testbed.chaos.timeline import (
    AGENT_DOWN,
    AGENT_STOPPED,
    ENGINE_HANG,
    ENGINE_RESTART,
    LeaseCommand,
    SeenCommand,
    UpdateRecord,
    Window,
)

SIZES = {"a": 2, "b": 1}
BOUNDS = Bounds(pause_lease_s=4.0, grace_s=8.0, converge_s=10.0)
ADAPTER = "policy-v1"


def committed(update_id: str = "u1", adapter: str = ADAPTER) -> UpdateResult:
    return UpdateResult(
        update_id=update_id,
        status="committed",
        adapter=adapter,
        version=1,
        rank_map=build_rank_map(SIZES),
        workers={
            w: WorkerOutcome(ok=True, world_size=s, adapters=[adapter]) for w, s in SIZES.items()
        },
    )


def failed(update_id: str, code: ErrorCode) -> UpdateResult:
    return UpdateResult(
        update_id=update_id,
        status="failed",
        adapter=ADAPTER,
        version=1,
        error=ErrorInfo(code=code, message=str(code)),
    )


def handled(worker_id: str, epoch: int, update_id: str = "u1") -> CommandHandled:
    return CommandHandled(
        ts=0.0,
        source=f"agent:{worker_id}",
        update_id=update_id,
        phase=Phase.PAUSE,
        worker_id=worker_id,
        ok=True,
        epoch=epoch,
    )


def clean() -> Timeline:
    """One update u1 of policy-v1 over a and b, epoch 1, requested at 1 and committed at 2."""
    t = Timeline(world_sizes=dict(SIZES))
    for worker_id in SIZES:
        t.agent_started(worker_id, 0.0)
        t.epoch_seen(worker_id, 1, 0.5)
        t.engine_adapters(worker_id, frozenset(), 0.0)
        t.command_seen(SeenCommand(1.1, 1, "pause", "u1", frozenset(SIZES)))
        t.lease_command(LeaseCommand(worker_id, 1.1, 1, "u1"))
        t.engine_paused(worker_id, True, 1.15)
        t.handled.append((1.2, handled(worker_id, 1)))
        t.engine_adapters(worker_id, frozenset({ADAPTER}), 1.5)
        t.engine_paused(worker_id, False, 1.8)
    t.updates.append(
        UpdateRecord(
            update_id="u1",
            version=1,
            path="/adapters/step_1",
            requested_at=1.0,
            answered_at=2.0,
            attempts=["committed"],
            result=committed(),
            asked_again=committed(),
        )
    )
    t.recovery_ids.add("u1")
    t.healed_at = 2.5
    t.final_committed = ADAPTER
    t.ended_at = 20.0
    return t


def test_a_clean_run_has_no_violations() -> None:
    assert check_all(clean(), BOUNDS) == []


# -- 1. pause leases ---------------------------------------------------------------


def test_an_engine_paused_past_lease_and_grace_is_a_violation() -> None:
    t = clean()
    t.engine_paused("a", True, 3.0)  # paused, with no lease command after it
    t.engine_paused("a", False, 3.0 + 4.0 + 8.0 + 0.5)

    [violation] = check_pause_leases(t, BOUNDS)

    assert violation.invariant == "pause_lease" and violation.subject == "a"
    assert "went 12.50s unattended, from the pause (t+3.00s) to its resume" in violation.detail


def test_an_engine_still_paused_at_the_end_is_judged_at_the_end() -> None:
    t = clean()
    t.engine_paused("b", True, 5.0)

    [violation] = check_pause_leases(t, BOUNDS)

    assert violation.subject == "b" and "still paused" in violation.detail
    assert "to the end of the run" in violation.detail


def test_renewals_keep_a_long_pause_legitimate() -> None:
    t = clean()
    t.engine_paused("a", True, 3.0)
    for at in range(4, 20, 1):
        t.lease_command(LeaseCommand("a", float(at), 1, "u2"))
    t.engine_paused("a", False, 19.5)

    assert check_pause_leases(t, BOUNDS) == []


@pytest.mark.parametrize("kind", [AGENT_STOPPED, AGENT_DOWN, ENGINE_HANG])
def test_the_bound_starts_when_a_fault_that_blocked_the_agent_clears(kind: str) -> None:
    t = clean()
    t.engine_paused("a", True, 3.0)
    t.windows.append(Window(kind, "a", 3.5, 13.0))
    t.engine_paused("a", False, 13.0 + 11.0)
    assert check_pause_leases(t, BOUNDS) == []

    t.pauses["a"][-1].end = 13.0 + 12.5
    [violation] = check_pause_leases(t, BOUNDS)
    assert f"from the end of its {kind} fault (t+13.00s)" in violation.detail


def test_a_later_pause_does_not_excuse_an_earlier_unattended_stretch() -> None:
    t = clean()
    t.engine_paused("a", True, 3.0)  # a pause nobody holds a lease on
    t.lease_command(LeaseCommand("a", 18.0, 1, "u2"))  # the next update pauses it again
    t.engine_paused("a", False, 18.1)  # ... and resumes it

    [violation] = check_pause_leases(t, BOUNDS)

    assert "went 15.00s unattended, from the pause (t+3.00s) to the next" in violation.detail


def test_time_inside_a_blocking_fault_does_not_count() -> None:
    t = clean()
    t.engine_paused("a", True, 3.0)
    t.windows.append(Window(AGENT_STOPPED, "a", 10.0, 30.0))
    t.engine_paused("a", False, 35.0)
    assert check_pause_leases(t, BOUNDS) == []

    t.windows[-1].start = 16.0  # 13 s unattended before the agent was stopped
    [violation] = check_pause_leases(t, BOUNDS)
    assert "to its agent_stopped fault" in violation.detail


def test_a_fault_on_another_worker_excuses_nothing() -> None:
    t = clean()
    t.engine_paused("a", True, 3.0)
    t.windows.append(Window(AGENT_STOPPED, "b", 3.5, 13.0))
    t.engine_paused("a", False, 24.0)

    assert [v.subject for v in check_pause_leases(t, BOUNDS)] == ["a"]


# -- 2. committed adapters are served ----------------------------------------------


def test_an_ok_member_whose_engine_lacks_the_committed_adapter_is_a_violation() -> None:
    t = clean()
    t.adapters["b"] = [(0.0, frozenset())]  # the load never reached the engine

    [violation] = check_committed_served(t, BOUNDS)

    assert violation.invariant == "committed_served" and violation.subject == "b"
    assert "no engine restart excuses it" in violation.detail


def test_an_engine_restarted_during_the_update_gets_time_to_reconcile() -> None:
    t = clean()
    t.instant(ENGINE_RESTART, "b", 1.9)
    t.engine_adapters("b", frozenset(), 1.9)
    t.engine_adapters("b", frozenset({ADAPTER}), 1.9 + 9.0)
    assert check_committed_served(t, BOUNDS) == []

    t.adapters["b"][-1] = (1.9 + 10.5, frozenset({ADAPTER}))
    [violation] = check_committed_served(t, BOUNDS)
    assert "was not back on it" in violation.detail


def test_reconciling_waits_for_a_blocked_agent() -> None:
    t = clean()
    t.instant(ENGINE_RESTART, "b", 1.9)
    t.engine_adapters("b", frozenset(), 1.9)
    t.windows.append(Window(AGENT_STOPPED, "b", 1.95, 8.0))
    t.engine_adapters("b", frozenset({ADAPTER}), 8.0 + 9.0)

    assert check_committed_served(t, BOUNDS) == []


def test_after_healing_every_engine_serves_the_last_commit() -> None:
    t = clean()
    t.engine_adapters("a", frozenset(), 2.2)  # lost it before the faults were healed

    [violation] = check_final_state(t, BOUNDS)

    assert violation.subject == "a" and "not the last committed policy-v1" in violation.detail


def test_the_coordinator_must_report_the_last_commit() -> None:
    t = clean()
    t.final_committed = "policy-v2"

    [violation] = check_final_state(t, BOUNDS)

    assert violation.subject == "coordinator"


# -- 3. rank maps -----------------------------------------------------------------------


def test_a_rank_map_with_wrong_offsets_is_a_violation() -> None:
    t = clean()
    good = committed().rank_map
    assert good is not None
    entries = [msgspec.structs.replace(e, rank_offset=1) for e in good.entries]
    bad = msgspec.structs.replace(good, entries=entries)
    t.updates[0].result = msgspec.structs.replace(committed(), rank_map=bad)

    [violation] = check_rank_maps(t, BOUNDS)

    assert (
        violation.invariant == "rank_map" and "b has rank offset 1, expected 3" in violation.detail
    )


def test_a_rank_map_that_leaves_out_an_ok_member_is_a_violation() -> None:
    t = clean()
    partial = build_rank_map({"a": 2})
    t.updates[0].result = msgspec.structs.replace(committed(), rank_map=partial)

    problems = [v.detail for v in check_rank_maps(t, BOUNDS)]

    assert any("are not the ok members" in p for p in problems), problems


def test_a_result_trimmed_to_fit_counts_its_rank_map_as_its_ok_members() -> None:
    t = clean()
    trimmed = msgspec.structs.replace(
        committed(), workers={}, trimmed=["adapters", "serving_workers"]
    )
    t.updates[0].result = trimmed
    assert check_rank_maps(t, BOUNDS) == []

    t.adapters["b"] = [(0.0, frozenset())]  # each member is still checked as serving
    [violation] = check_committed_served(t, BOUNDS)
    assert violation.subject == "b"


def test_a_rank_map_with_a_wrong_world_size_is_a_violation() -> None:
    t = clean()
    t.world_sizes["a"] = 4  # the engine's true size

    [violation] = check_rank_maps(t, BOUNDS)

    assert "a has world size 2 in the rank map, its engine has 4" in violation.detail


def test_one_membership_keeps_one_version() -> None:
    t = clean()
    second = committed("u2", "policy-v2")
    assert second.rank_map is not None
    renamed = msgspec.structs.replace(second.rank_map, membership_version="other")
    t.updates.append(
        UpdateRecord(
            update_id="u2",
            version=2,
            path="/adapters/step_2",
            requested_at=3.0,
            answered_at=3.5,
            result=msgspec.structs.replace(second, rank_map=renamed),
        )
    )

    [violation] = check_rank_maps(t, BOUNDS)

    assert violation.subject == "u2" and "the same membership had" in violation.detail


# -- 4. terminal results ------------------------------------------------------------------


def test_a_request_without_a_terminal_result_is_a_violation() -> None:
    t = clean()
    t.updates.append(
        UpdateRecord(
            update_id="u2",
            version=2,
            path="/adapters/step_2",
            requested_at=3.0,
            attempts=["failed:timeout", "failed:no_coordinator"],
        )
    )

    [violation] = check_terminal_results(t)

    assert violation.subject == "u2" and "failed:timeout, failed:no_coordinator" in violation.detail


def test_an_internal_error_is_not_a_clean_failure() -> None:
    t = clean()
    t.updates[0].result = failed("u1", ErrorCode.INTERNAL)
    t.updates[0].asked_again = None

    assert [v.invariant for v in check_terminal_results(t)] == ["terminal_result"]


def test_asking_again_must_give_the_same_status() -> None:
    t = clean()
    t.updates[0].asked_again = failed("u1", ErrorCode.STALE_VERSION)

    [violation] = check_terminal_results(t)

    assert "asking again" in violation.detail


def test_asking_again_without_an_answer_proves_nothing() -> None:
    t = clean()
    t.updates[0].asked_again = failed("u1", ErrorCode.TIMEOUT)

    assert check_terminal_results(t) == []


# -- 5. fencing ------------------------------------------------------------------------------


def _refused(command: str, epoch: int, epoch_seen: int, reason: str) -> CommandRefused:
    return CommandRefused(
        ts=0.0,
        source="agent:a",
        update_id="u1",
        worker_id="a",
        command=command,
        epoch=epoch,
        epoch_seen=epoch_seen,
        reason=reason,
    )


def test_refusing_a_current_epoch_is_a_violation() -> None:
    t = clean()
    t.refused.append((1.3, _refused("pause", 2, 2, "it has seen epoch 2")))

    [violation] = check_fencing(t)

    assert violation.invariant == "fencing" and "had only seen epoch 2" in violation.detail


def test_a_command_refused_as_ahead_of_the_leader_record_is_no_fencing_violation() -> None:
    """After a partition heals, an agent may hear a new epoch's command before
    it has read that epoch's leader record: it drops it unproven (the leader
    sends it again), which is not the agent fencing a current epoch off."""
    t = clean()
    ahead = "epoch 4 is not in the fleet's leader record (which shows 3)"
    t.refused.append((1.3, _refused("resume", 4, 3, ahead)))

    assert check_fencing(t) == []


def test_acting_on_a_command_that_was_stale_when_sent_is_a_violation() -> None:
    t = clean()
    t.epoch_seen("a", 3, 5.0)
    t.command_seen(SeenCommand(6.0, 2, "pause", "u9", frozenset({"a"})))
    t.handled.append((6.1, handled("a", 2, "u9")))

    [violation] = check_fencing(t)

    assert violation.subject == "a" and "after the agent had reported epoch 3" in violation.detail


def test_a_restarted_agent_starts_from_the_epoch_it_learns() -> None:
    t = clean()
    t.epoch_seen("a", 3, 5.0)
    t.agent_started("a", 5.5)  # a new process: it has seen nothing yet
    t.command_seen(SeenCommand(6.0, 2, "pause", "u9", frozenset({"a"})))
    t.handled.append((6.1, handled("a", 2, "u9")))

    assert check_fencing(t) == []


def test_a_handled_command_is_matched_by_its_epoch() -> None:
    t = clean()
    t.epoch_seen("a", 3, 5.0)
    t.command_seen(SeenCommand(6.0, 2, "pause", "u9", frozenset({"a"})))  # stale
    t.command_seen(SeenCommand(6.0, 3, "pause", "u9", frozenset({"a"})))  # current
    t.handled.append((6.1, handled("a", 3, "u9")))
    assert check_fencing(t) == []

    t.handled.append((6.2, handled("a", 2, "u9")))
    assert [v.subject for v in check_fencing(t)] == ["a"]


# -- 6. recovery and 7. crashes -----------------------------------------------------------------


def test_no_commit_after_healing_is_a_violation() -> None:
    t = clean()
    t.updates[0].result = failed("u1", ErrorCode.QUORUM_TIMEOUT)
    t.updates[0].asked_again = None

    [violation] = check_recovery(t)

    assert violation.invariant == "recovery" and "quorum_timeout" in violation.detail


def test_a_process_that_exits_on_its_own_is_a_violation() -> None:
    t = clean()
    t.crashes.append("agent-a (pid 42) exited 1; log /tmp/agent-a.1.log:\nTraceback ...")

    assert [(v.invariant, v.subject) for v in check_all(t, BOUNDS)] == [("crash", "agent-a")]


# -- 8. one call rides out a frozen leader ------------------------------------------------


def asked_once(outcome: UpdateResult, call_s: float = 6.0) -> UpdateRecord:
    """u2, asked with one client call (timeout 70 s) while leader c1 was frozen."""
    terminal = (
        outcome.committed
        or outcome.error is None
        or outcome.error.code
        not in (
            ErrorCode.TIMEOUT,
            ErrorCode.NO_COORDINATOR,
        )
    )
    status = "committed" if outcome.committed else f"failed:{outcome.error and outcome.error.code}"
    return UpdateRecord(
        update_id="u2",
        version=2,
        path="/adapters/step_2",
        requested_at=3.0,
        answered_at=3.0 + call_s if terminal else None,
        attempts=[status],
        result=outcome if terminal else None,
        one_call_timeout_s=70.0,
        frozen_leader="c1",
        call_s=call_s,
    )


def test_a_frozen_leader_request_that_times_out_is_a_violation() -> None:
    t = clean()
    t.updates.append(asked_once(failed("u2", ErrorCode.TIMEOUT), call_s=70.0))

    violations = check_all(t, BOUNDS)

    assert [(v.invariant, v.subject) for v in violations] == [("frozen_leader_request", "u2")]
    assert "leader c1 frozen" in violations[0].detail
    assert "failed:timeout" in violations[0].detail


def test_a_frozen_leader_request_failed_with_a_code_of_its_own_is_terminal() -> None:
    t = clean()
    t.updates.append(asked_once(failed("u2", ErrorCode.SUPERSEDED)))

    assert check_one_call_requests(t) == []
    assert check_terminal_results(t) == []


def test_a_frozen_leader_request_that_returns_past_its_timeout_is_a_violation() -> None:
    t = clean()
    t.updates.append(asked_once(failed("u2", ErrorCode.PHASE_TIMEOUT), call_s=75.0))

    [violation] = check_one_call_requests(t)

    assert "past its timeout of 70.0s" in violation.detail


def test_a_hung_frozen_leader_request_is_a_violation() -> None:
    t = clean()
    record = asked_once(failed("u2", ErrorCode.TIMEOUT), call_s=80.0)
    record.attempts = ["hung: no return within 80s"]
    t.updates.append(record)

    [violation] = check_one_call_requests(t)

    assert "hung" in violation.detail


# -- 9. unnoticed pauses -----------------------------------------------------------


def test_an_engine_paused_while_its_agent_reports_it_running_is_a_violation() -> None:
    """The pause landed after its agent gave up on it: the agent beats
    'running' for seconds while the engine is paused."""
    t = clean()
    t.engine_paused("a", True, 5.0)
    for at in (5.5, 6.0, 6.5, 7.0, 7.5):
        t.heartbeat("a", False, at)
    t.engine_paused("a", False, 8.0)

    [violation] = check_unnoticed_pauses(t)

    assert (violation.invariant, violation.subject) == ("unnoticed_pause", "a")
    assert "its agent reported it running from t+6.00s to t+7.50s" in violation.detail


def test_an_agent_that_reports_its_engine_maybe_paused_is_no_violation() -> None:
    t = clean()
    t.engine_paused("a", True, 5.0)
    for at in (5.5, 6.0, 6.5, 7.0, 7.5):
        t.heartbeat("a", True, at)
    t.engine_paused("a", False, 8.0)

    assert check_unnoticed_pauses(t) == []
