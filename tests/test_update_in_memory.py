"""One update's lifecycle with the real agents and the real coordinator, in memory.

Nothing plays the agent or the coordinator: :class:`~memory_fleet.InMemoryFleet`
runs both for real on the in-memory bus (``memory_bus.py``) under looptime's
fake clock, and every misbehaviour is the engine's (a failed load, a refused
pause, a worker that dies) or the bus's (a command or an ack lost on the way).
What only a real nats-server shows is tested against one, with the same real
parts (``make_stack``: test_update_commits.py, test_update_fails_cleanly.py,
test_partial_quorum.py, test_resend_and_dedupe.py, test_agent_killed.py,
test_fencing_and_leases.py, test_withdraw_after_pause.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import msgspec
import pytest
from memory_fleet import InMemoryFleet

from lorabus.schemas import (
    ErrorCode,
    InflightRecord,
    LoadCommand,
    Naming,
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


def _inflight_records(fleet: InMemoryFleet) -> list[InflightRecord]:
    """Every in-flight record the coordinator wrote, oldest first (the last
    one is cleared once the result is stored)."""
    bucket = fleet.server.buckets[fleet.subjects.state_bucket()]
    return [
        msgspec.json.decode(entry.value, type=InflightRecord)
        for entry in bucket.history("inflight.policy")
        if entry.value
    ]


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
        # The load rides on the pause: no command of its own.
        pause = fleet.sent_to(worker_id)[0]
        assert isinstance(pause, PauseCommand) and pause.then_load is not None
        assert pause.then_load.served_name == "policy-v1"
        # The canary comes after the resume: a paused engine holds generations.
        assert _phases(fleet, worker_id) == [Phase.PAUSE, Phase.RESUME, Phase.CANARY], worker_id
        assert fleet.phases_acked(worker_id) == [Phase.LOAD, Phase.RESUME, Phase.CANARY]
        assert engine.canaries == ["policy-v1"], worker_id
        assert not engine.paused
    _nobody_paused(fleet)
    recorded = _inflight_records(fleet)
    assert recorded and recorded[-1].phase is Phase.LOAD
    assert recorded[-1].members == WORLD_SIZES


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
    # Left out for its pause, not for the load it carried, which it refused.
    assert "cannot pause" in _error_of(result, "w2")
    pause = fleet.sent_to("w2")[0]
    assert isinstance(pause, PauseCommand) and pause.then_load is not None
    loads = [a for a in fleet.acks if a.worker_id == "w2" and a.phase is Phase.LOAD]
    assert loads and loads[0].error is not None, loads
    assert loads[0].error.code is ErrorCode.NOT_PAUSED
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
    _nobody_paused(fleet)


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
    # It died in its load, but the ack of its pause was held to ride inside the
    # load's (``ack_hold_s``): to the coordinator the pause had not ended.
    assert "stopped heartbeating during pause" in _error_of(result, "w2")
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
    assert not [c for c in fleet.sent_to("w0") if isinstance(c, PauseCommand) and c.cohort]
    assert fleet.engines["w0"].adapters == ["policy-v1"]
    _nobody_paused(fleet)


async def test_without_a_quorum_no_engine_is_paused(open_fleet: OpenFleet) -> None:
    fleet = await open_fleet(expected_world_size=100, quorum_timeout_s=1)
    result = await _update(fleet)

    assert result.error is not None and result.error.code is ErrorCode.QUORUM_TIMEOUT
    assert "sum to 7, which is short of the expected 100" in result.error.message
    assert not any(fleet.sent_to(w) for w in WORLD_SIZES)
    _nobody_paused(fleet)


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


async def test_a_pause_that_fails_on_one_member_withdraws_the_load_it_carried_elsewhere(
    open_fleet: OpenFleet,
) -> None:
    # w2's pause lands, and runs the load it carried, but none of its answers
    # reach the coordinator: the others loaded right behind their own pause.
    fleet = await open_fleet(phase_timeout_s=2)
    fleet.lose_acks("w2", Phase.PAUSE)
    fleet.lose_acks("w2", Phase.LOAD)  # the pause's ack may ride inside the load's
    w2_loaded = _counting_loads(fleet, "w2")
    result = await _update(fleet)

    assert result.status == "failed"
    assert result.error is not None and "pause failed" in result.error.message
    assert "no pause ack within 2.0s" in _error_of(result, "w2")
    # The loads were not waited for once the pause had failed the update.
    assert Phase.LOAD not in result.phases
    for worker_id in ("w0", "w1"):
        pause = fleet.sent_to(worker_id)[0]
        assert isinstance(pause, PauseCommand) and pause.then_load is not None
        assert Phase.LOAD in fleet.phases_acked(worker_id), worker_id
        assert _phases(fleet, worker_id)[-1] is Phase.UNLOAD, worker_id
    assert Phase.LOAD not in _phases(fleet, "w2")
    # Its pause landed and ran the load it carried: withdrawn there too.
    assert w2_loaded == [1]
    assert _phases(fleet, "w2")[-1] is Phase.UNLOAD
    assert all("policy-v1" not in e.adapters for e in fleet.engines.values())
    _nobody_paused(fleet)


async def test_a_member_left_out_for_its_pause_is_withdrawn_from_when_the_update_fails(
    open_fleet: OpenFleet,
) -> None:
    # w2's pause goes unanswered (it lands, with its load); w1's load fails,
    # which leaves too little of the fleet to commit.
    fleet = await open_fleet(phase_timeout_s=2, quorum=0.75)
    fleet.lose_acks("w2", Phase.PAUSE)
    fleet.lose_acks("w2", Phase.LOAD)
    fleet.engines["w1"].fail_load = True
    w2_loaded = _counting_loads(fleet, "w2")
    result = await _update(fleet)

    assert result.status == "failed"
    assert "no pause ack" in _error_of(result, "w2")
    assert "cannot load policy-v1" in _error_of(result, "w1")
    assert w2_loaded == [1]
    for worker_id in ("w0", "w2"):
        assert _phases(fleet, worker_id)[-1] is Phase.UNLOAD, worker_id
    assert all("policy-v1" not in e.adapters for e in fleet.engines.values())
    _nobody_paused(fleet)


async def test_a_fixed_name_load_waits_for_the_whole_fleet_pause(open_fleet: OpenFleet) -> None:
    fleet = await open_fleet(naming=Naming.FIXED)
    calls: list[tuple[str, str]] = []
    for worker_id, engine in fleet.engines.items():
        engine.on_pause = _noting(calls, "pause", worker_id)
        engine.on_load = _noting(calls, "load", worker_id)
    result = await _update(fleet)

    assert result.committed, result.error
    assert result.adapter == "policy"
    for worker_id, engine in fleet.engines.items():
        pause = fleet.sent_to(worker_id)[0]
        assert isinstance(pause, PauseCommand) and pause.then_load is None
        assert _phases(fleet, worker_id) == [
            Phase.PAUSE,
            Phase.LOAD,
            Phase.RESUME,
            Phase.CANARY,
        ]
        assert engine.adapters == ["policy"], worker_id
    # Every engine paused before any loaded.
    kinds = [kind for kind, _ in calls]
    assert kinds == ["pause"] * len(WORLD_SIZES) + ["load"] * len(WORLD_SIZES), calls
    _nobody_paused(fleet)


async def test_the_frontend_is_looked_at_once_one_member_loaded_while_another_still_loads(
    open_fleet: OpenFleet,
) -> None:
    # w2 misses its first pause, and with it the load it carries: it loads
    # only when the pause is sent again. The listing, a union over workers,
    # is looked for before that.
    fleet = await open_fleet()
    fleet.lose("w2", Phase.PAUSE)
    result = await _update(fleet)

    assert result.committed, result.error
    first_look = fleet.frontend.first_look
    assert first_look and "w2" not in first_look, first_look
    assert all(e.adapters == ["policy-v1"] for e in fleet.engines.values())


def _counting_loads(fleet: InMemoryFleet, worker_id: str) -> list[int]:
    """How many loads ``worker_id``'s engine began (one item, counted up)."""
    count = [0]

    async def on_load() -> None:
        count[0] += 1

    fleet.engines[worker_id].on_load = on_load
    return count


def _noting(calls: list[tuple[str, str]], kind: str, worker_id: str) -> Callable[[], Any]:
    async def note() -> None:
        calls.append((kind, worker_id))

    return note
