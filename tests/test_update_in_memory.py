"""One update's lifecycle with the real agents and the real coordinator, in memory.

The scenarios of ``test_update_lifecycle.py``, but nothing plays the agent or
the coordinator: :class:`~memory_fleet.InMemoryFleet` runs both for real on
the in-memory bus (``memory_bus.py``) under looptime's fake clock, and every
misbehaviour is the engine's (a failed load, a refused pause, a worker that
dies) or the bus's (a command or an ack lost on the way).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
from memory_fleet import InMemoryFleet

from lorabus.schemas import (
    ErrorCode,
    LoadCommand,
    PauseCommand,
    Phase,
    RenewLeaseCommand,
    UnloadCommand,
    UpdateResult,
    phase_of,
)

pytestmark = pytest.mark.looptime

WORLD_SIZES = {"w0": 2, "w1": 4, "w2": 1}
OpenFleet = Callable[..., Any]


@pytest.fixture
async def open_fleet() -> AsyncIterator[OpenFleet]:
    async with AsyncExitStack() as stack:

        async def open_(**settings: Any) -> InMemoryFleet:
            return await stack.enter_async_context(InMemoryFleet(WORLD_SIZES, **settings))

        yield open_


async def _update(fleet: InMemoryFleet) -> UpdateResult:
    return await fleet.client().update(
        "policy", "/adapters/policy/step_1", version=1, update_id="u1", timeout_s=600
    )


def _phases(fleet: InMemoryFleet, worker_id: str) -> list[Phase]:
    phases = []
    for command in fleet.sent_to(worker_id):
        try:
            phases.append(phase_of(command))  # type: ignore[arg-type]
        except ValueError:
            continue
    return phases


def _nobody_paused(fleet: InMemoryFleet) -> None:
    assert {w: e.paused for w, e in fleet.engines.items()} == dict.fromkeys(WORLD_SIZES, False)


def _error_of(result: UpdateResult, worker_id: str) -> str:
    outcome = result.workers[worker_id]
    assert not outcome.ok and outcome.error is not None, outcome
    return outcome.error.message


async def test_every_member_acks_and_the_update_commits_with_its_rank_map(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet()
    result = await _update(fleet)

    assert result.committed, result.error
    assert result.rank_map is not None
    offsets = {e.worker_id: (e.rank_offset, e.world_size) for e in result.rank_map.entries}
    assert offsets == {"w0": (1, 2), "w1": (3, 4), "w2": (7, 1)}
    assert result.rank_map.world_size == 8
    for worker_id, engine in fleet.engines.items():
        assert engine.adapters == ["policy-v1"], worker_id
    _nobody_paused(fleet)


async def test_a_failed_load_fails_the_update_resumes_everyone_and_withdraws_the_version(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet()
    fleet.engines["w1"].fail_load = True
    result = await _update(fleet)

    assert result.status == "failed"
    assert result.error is not None and result.error.code is ErrorCode.WORKER_FAILED
    assert "cannot load policy-v1" in _error_of(result, "w1")
    assert result.rank_map is None
    _nobody_paused(fleet)
    assert all("policy-v1" not in e.adapters for e in fleet.engines.values())
    assert _phases(fleet, "w0")[-1] is Phase.UNLOAD


async def test_a_partial_quorum_commits_without_the_member_that_failed(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet(quorum=0.75)
    fleet.engines["w2"].fail_load = True
    result = await _update(fleet)

    assert result.committed, result.error
    assert result.rank_map is not None
    assert [e.worker_id for e in result.rank_map.entries] == ["w0", "w1"]
    assert "cannot load policy-v1" in _error_of(result, "w2")
    _nobody_paused(fleet)


async def test_a_member_whose_engine_refused_the_pause_is_left_out(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet(quorum=0.75)
    fleet.engines["w2"].fail_pause = True
    result = await _update(fleet)

    assert result.committed, result.error
    assert result.rank_map is not None
    assert [e.worker_id for e in result.rank_map.entries] == ["w0", "w1"]
    assert "cannot pause" in _error_of(result, "w2")
    assert "policy-v1" not in fleet.engines["w2"].adapters
    _nobody_paused(fleet)


async def test_a_member_whose_pause_never_completes_is_left_out_and_sent_no_load(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet(phase_timeout_s=2, quorum=0.75)
    fleet.engines["w2"].on_pause = asyncio.Event().wait
    result = await _update(fleet)

    assert result.committed, result.error
    assert result.rank_map is not None
    assert [e.worker_id for e in result.rank_map.entries] == ["w0", "w1"]
    assert "no pause ack" in _error_of(result, "w2")
    # The load's re-sends go only to members whose pause held.
    assert not [c for c in fleet.sent_to("w2") if isinstance(c, LoadCommand)]
    assert "policy-v1" not in fleet.engines["w2"].adapters


async def test_a_member_that_never_acks_times_the_phase_out_and_everyone_resumes(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet(phase_timeout_s=2)
    fleet.lose_acks("w2", Phase.LOAD)
    result = await _update(fleet)

    assert result.error is not None and result.error.code is ErrorCode.PHASE_TIMEOUT
    # The load goes out with the pause: its deadline is both phases' timeouts.
    assert "no load ack within 4.0s" in _error_of(result, "w2")
    _nobody_paused(fleet)
    # Its load did land: it is told to unload behind it, unasked.
    unloads = [c for c in fleet.sent_to("w2") if isinstance(c, UnloadCommand)]
    assert unloads and unloads[-1].names == ["policy-v1"] and unloads[-1].targets == ["w2"]
    assert "policy-v1" not in fleet.engines["w2"].adapters


async def test_a_member_that_stops_heartbeating_is_given_up_before_the_deadline(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet(phase_timeout_s=60)

    async def worker_dies() -> None:
        fleet.connections["w2"].cut()
        await asyncio.Event().wait()

    fleet.engines["w2"].on_load = worker_dies
    result = await _update(fleet)

    assert result.error is not None and result.error.code is ErrorCode.PHASE_TIMEOUT
    assert "stopped heartbeating during" in _error_of(result, "w2")
    assert not fleet.engines["w0"].paused and not fleet.engines["w1"].paused


async def test_a_member_that_missed_a_command_gets_it_again_on_its_own_subject(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet()
    fleet.lose("w0", Phase.PAUSE)
    result = await _update(fleet)

    assert result.committed, result.error
    again = [
        (subject, c.targets)
        for subject, c in fleet.commands
        if isinstance(c, PauseCommand) and subject == fleet.subjects.cmd_worker("w0")
    ]
    assert len(again) >= 2 and all(targets == ["w0"] for _, targets in again), again
    assert fleet.engines["w0"].adapters == ["policy-v1"]
    _nobody_paused(fleet)


async def test_without_a_quorum_no_engine_is_paused(open_fleet: OpenFleet) -> None:
    fleet = await open_fleet(expected_world_size=100, quorum_timeout_s=1)
    result = await _update(fleet)

    assert result.error is not None and result.error.code is ErrorCode.QUORUM_TIMEOUT
    assert "sum to 7, which is short of the expected 100" in result.error.message
    assert not any(_phases(fleet, w) for w in WORLD_SIZES)


async def test_pause_leases_are_renewed_while_the_pause_lasts(open_fleet: OpenFleet) -> None:
    fleet = await open_fleet(pause_lease_s=1.5, phase_timeout_s=3)
    fleet.lose_acks("w1", Phase.LOAD)
    result = await _update(fleet)

    assert result.error is not None and result.error.code is ErrorCode.PHASE_TIMEOUT
    sent = fleet.sent_to("w0")
    pause = next(c for c in sent if isinstance(c, PauseCommand))
    renewals = [c for c in sent if isinstance(c, RenewLeaseCommand)]
    assert pause.lease_s == 1.5
    assert renewals and all(r.lease_s == 1.5 and r.cohort for r in renewals)
    _nobody_paused(fleet)
