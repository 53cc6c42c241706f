"""The fault schedule is a pure function of its seed, and covers every kind early."""

from __future__ import annotations

import math

import pytest

from lorabus.testbed.chaos import ALL_KINDS, FaultKind, build_schedule
from lorabus.testbed.chaos.schedule import CONTROL, CONTROL_KINDS

WORKERS = ["w000", "w001", "w002", "w003"]


def test_the_same_seed_gives_the_same_schedule() -> None:
    assert build_schedule(7, 300, WORKERS) == build_schedule(7, 300, WORKERS)


def test_another_seed_gives_another_schedule() -> None:
    assert build_schedule(7, 300, WORKERS) != build_schedule(8, 300, WORKERS)


def test_the_schedule_does_not_depend_on_the_order_of_the_worker_ids() -> None:
    assert build_schedule(3, 120, WORKERS) == build_schedule(3, 120, list(reversed(WORKERS)))


def test_the_first_faults_cover_every_kind_once() -> None:
    for seed in range(20):
        first = build_schedule(seed, 300, WORKERS)[: len(ALL_KINDS)]
        assert {f.kind for f in first} == set(ALL_KINDS), seed


def test_faults_start_within_the_run_in_order() -> None:
    faults = build_schedule(1, 60, WORKERS, warmup_s=2.0)
    starts = [f.at_s for f in faults]
    assert starts == sorted(starts)
    assert all(2.0 <= at < 60 for at in starts)


def test_a_target_holds_one_fault_at_a_time() -> None:
    for seed in range(20):
        busy_until: dict[str, float] = {}
        for fault in build_schedule(seed, 300, WORKERS, mean_gap_s=1.0):
            assert busy_until.get(fault.occupies, 0.0) <= fault.at_s, (seed, fault)
            busy_until[fault.occupies] = fault.at_s + fault.hold_s


def test_targets_and_parameters_fit_their_kind() -> None:
    for fault in build_schedule(5, 600, WORKERS):
        if fault.kind in CONTROL_KINDS:
            assert fault.target == CONTROL
        else:
            assert fault.target in WORKERS
        assert bool(fault.latency_s) == (fault.kind is FaultKind.ENGINE_LATENCY)
        assert (fault.fail_loads > 0) == (fault.kind is FaultKind.ENGINE_ERROR)


def test_a_schedule_can_be_limited_to_some_kinds() -> None:
    kinds = [FaultKind.AGENT_KILL, FaultKind.ENGINE_HANG]
    assert {f.kind for f in build_schedule(2, 300, WORKERS, kinds=kinds)} == set(kinds)


def test_a_schedule_can_be_counted_instead_of_timed() -> None:
    counted = build_schedule(4, math.inf, WORKERS, mean_gap_s=0.5, count=1000)
    assert len(counted) == 1000
    assert counted[:20] == build_schedule(4, counted[19].at_s + 0.01, WORKERS, mean_gap_s=0.5)


def test_an_endless_schedule_needs_a_count() -> None:
    with pytest.raises(ValueError, match="count"):
        build_schedule(4, math.inf, WORKERS)


def test_a_frozen_leader_request_occupies_the_control_target() -> None:
    [first, *_] = build_schedule(1, 30, WORKERS, kinds=[FaultKind.FROZEN_LEADER_REQUEST])
    assert first.target == CONTROL and first.occupies == CONTROL
