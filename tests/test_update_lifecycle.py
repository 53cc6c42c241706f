"""One update's lifecycle, scenario by scenario, on two buses.

Each scenario runs the real update runner, membership and ack gathering
against scripted agents (``fleet_doubles.py``), once on an in-memory bus
under a fake loop clock (milliseconds, whatever the timeouts say) and once
on a real nats-server with the real clock.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import msgspec
import pytest
from fleet_doubles import ListingFrontend, MemoryFleet, NatsFleet, Script

from lorabus.bus import close, connect
from lorabus.coordinator.plan import UpdatePlan
from lorabus.schemas import (
    ErrorCode,
    PauseCommand,
    Phase,
    RenewLeaseCommand,
    UnloadCommand,
    UpdateResult,
)

WORLD_SIZES = {"w0": 2, "w1": 4, "w2": 1}
PLAN = UpdatePlan(
    update_id="u1",
    adapter="policy",
    version=1,
    path="/adapters/policy/step_1",
    served_name="policy-v1",
    replace=False,
)

Fleet = MemoryFleet | NatsFleet
OpenFleet = Callable[..., Awaitable[Fleet]]


@pytest.fixture(params=[pytest.param("memory", marks=pytest.mark.looptime), "nats"])
def bus_url(request: pytest.FixtureRequest) -> str | None:
    """None for the in-memory bus (on a fake clock), else a real nats-server's URL."""
    return None if request.param == "memory" else request.getfixturevalue("nats_url")


@pytest.fixture
async def open_fleet(bus_url: str | None, fleet_name: str) -> AsyncIterator[OpenFleet]:
    async with contextlib.AsyncExitStack() as stack:

        async def open_(scripts: Mapping[str, Script] | None = None) -> Fleet:
            if bus_url is None:
                return await stack.enter_async_context(MemoryFleet(WORLD_SIZES, scripts or {}))
            coordinator_nc = await connect(bus_url, name="lifecycle-coordinator")
            stack.push_async_callback(close, coordinator_nc)
            agents_nc = await connect(bus_url, name="lifecycle-agents")
            stack.push_async_callback(close, agents_nc)
            fleet = NatsFleet(
                WORLD_SIZES,
                scripts or {},
                coordinator_nc=coordinator_nc,
                agents_nc=agents_nc,
                fleet=fleet_name,
            )
            return await stack.enter_async_context(fleet)

        yield open_


def _nobody_paused(fleet: Fleet) -> None:
    assert {wid: a.paused for wid, a in fleet.agents.items()} == dict.fromkeys(WORLD_SIZES, False)


def _error_of(result: UpdateResult, worker_id: str) -> str:
    outcome = result.workers[worker_id]
    assert not outcome.ok and outcome.error is not None, outcome
    return outcome.error.message


async def test_every_member_acks_and_the_update_commits_with_its_rank_map(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet()
    result = (await fleet.runner().run(PLAN)).result

    assert result.committed, result.error
    assert result.rank_map is not None
    offsets = {e.worker_id: (e.rank_offset, e.world_size) for e in result.rank_map.entries}
    assert offsets == {"w0": (1, 2), "w1": (3, 4), "w2": (7, 1)}
    assert result.rank_map.world_size == 8
    for agent in fleet.agents.values():
        assert agent.phases_received() == [Phase.PAUSE, Phase.LOAD, Phase.RESUME]
        assert agent.adapters == ["policy-v1"]
    _nobody_paused(fleet)
    recorded = await fleet.last_inflight()
    assert recorded is not None and recorded.phase is Phase.LOAD
    assert recorded.members == WORLD_SIZES


async def test_a_failed_load_fails_the_update_resumes_everyone_and_withdraws_the_version(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet({"w1": Script(fail_load=True)})
    result = (await fleet.runner().run(PLAN)).result

    assert result.status == "failed"
    assert result.error is not None and result.error.code is ErrorCode.WORKER_FAILED
    assert "cannot load policy-v1" in _error_of(result, "w1")
    assert result.rank_map is None
    _nobody_paused(fleet)
    assert all("policy-v1" not in a.adapters for a in fleet.agents.values())
    assert fleet.agents["w0"].phases_received()[-1] is Phase.UNLOAD


async def test_a_pause_that_fails_on_one_member_withdraws_the_load_it_carried_elsewhere(
    open_fleet: OpenFleet,
) -> None:
    # w2's pause never completes: the others loaded right behind their own pause.
    fleet = await open_fleet({"w2": Script(silent=frozenset({Phase.PAUSE}))})
    result = (await fleet.runner(phase_timeout_s=2).run(PLAN)).result

    assert result.status == "failed"
    assert result.error is not None and "pause failed" in result.error.message
    assert "no pause ack within 2.0s" in _error_of(result, "w2")
    # The loads were not waited for once the pause had failed the update.
    assert Phase.LOAD not in result.phases
    for worker_id in ("w0", "w1"):
        received = fleet.agents[worker_id].phases_received()
        assert received[:2] == [Phase.PAUSE, Phase.LOAD] and received[-1] is Phase.UNLOAD
    assert Phase.LOAD not in fleet.agents["w2"].phases_received()
    # Its pause may still land, and run the load it carried: withdrawn there too.
    assert fleet.agents["w2"].phases_received()[-1] is Phase.UNLOAD
    assert all("policy-v1" not in a.adapters for a in fleet.agents.values())
    _nobody_paused(fleet)


async def test_a_member_whose_pause_never_acked_is_left_out_and_sent_no_load(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet({"w2": Script(silent=frozenset({Phase.PAUSE}))})
    result = (await fleet.runner(phase_timeout_s=2, quorum=0.75).run(PLAN)).result

    assert result.committed, result.error
    assert result.rank_map is not None
    assert [e.worker_id for e in result.rank_map.entries] == ["w0", "w1"]
    assert "no pause ack" in _error_of(result, "w2")
    # The load's re-sends go only to members whose pause held.
    assert Phase.LOAD not in fleet.agents["w2"].phases_received()
    _nobody_paused(fleet)


async def test_a_member_left_out_for_its_pause_is_withdrawn_from_when_the_update_fails(
    open_fleet: OpenFleet,
) -> None:
    # w2's pause goes unanswered (it may land late, with its load); w1's load
    # fails, which leaves too little of the fleet to commit.
    scripts = {"w2": Script(silent=frozenset({Phase.PAUSE})), "w1": Script(fail_load=True)}
    fleet = await open_fleet(scripts)
    result = (await fleet.runner(phase_timeout_s=2, quorum=0.75).run(PLAN)).result

    assert result.status == "failed"
    for worker_id in ("w0", "w2"):
        assert fleet.agents[worker_id].phases_received()[-1] is Phase.UNLOAD, worker_id
    assert all("policy-v1" not in a.adapters for a in fleet.agents.values())
    _nobody_paused(fleet)


async def test_a_fixed_name_load_waits_for_the_whole_fleet_pause(open_fleet: OpenFleet) -> None:
    fleet = await open_fleet()
    fixed = msgspec.structs.replace(PLAN, served_name="policy", replace=True)
    result = (await fleet.runner().run(fixed)).result

    assert result.committed, result.error
    for agent in fleet.agents.values():
        pause = agent.received[0]
        assert isinstance(pause, PauseCommand) and pause.then_load is None
        assert agent.phases_received() == [Phase.PAUSE, Phase.LOAD, Phase.RESUME]
        assert agent.adapters == ["policy"]
    _nobody_paused(fleet)


async def test_a_member_whose_engine_refused_the_pause_refuses_its_load_and_is_left_out(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet({"w2": Script(fail_pause=True)})
    result = (await fleet.runner(quorum=0.75).run(PLAN)).result

    assert result.committed, result.error
    assert result.rank_map is not None
    assert [e.worker_id for e in result.rank_map.entries] == ["w0", "w1"]
    # Left out for its pause, not for the load it refused.
    assert "cannot pause" in _error_of(result, "w2")
    assert fleet.agents["w2"].phases_received()[:2] == [Phase.PAUSE, Phase.LOAD]
    assert "policy-v1" not in fleet.agents["w2"].adapters
    _nobody_paused(fleet)


async def test_a_member_that_never_acks_times_the_phase_out_and_everyone_resumes(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet({"w2": Script(silent=frozenset({Phase.LOAD}))})
    result = (await fleet.runner(phase_timeout_s=2).run(PLAN)).result

    assert result.error is not None and result.error.code is ErrorCode.PHASE_TIMEOUT
    # The load goes out with the pause: its deadline is both phases' timeouts.
    assert "no load ack within 4.0s" in _error_of(result, "w2")
    _nobody_paused(fleet)
    # Its load may still land: it is told to unload behind it, unasked.
    unloads = [c for c in fleet.agents["w2"].received if isinstance(c, UnloadCommand)]
    assert unloads and unloads[-1].names == ["policy-v1"] and unloads[-1].targets == ["w2"]


async def test_a_member_that_stops_heartbeating_is_given_up_before_the_deadline(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet({"w2": Script(dies_at=Phase.LOAD)})
    result = (await fleet.runner(phase_timeout_s=60).run(PLAN)).result

    assert result.error is not None and result.error.code is ErrorCode.PHASE_TIMEOUT
    assert "stopped heartbeating during load" in _error_of(result, "w2")
    assert not fleet.agents["w0"].paused and not fleet.agents["w1"].paused


async def test_a_member_that_missed_a_command_gets_it_again_on_its_own_subject(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet({"w0": Script(lose_first=frozenset({Phase.PAUSE, Phase.LOAD}))})
    result = (await fleet.runner().run(PLAN)).result

    assert result.committed, result.error
    w0 = fleet.agents["w0"]
    assert w0.phases_received() == [Phase.PAUSE, Phase.LOAD, Phase.RESUME]
    again = [c for c in w0.received if not isinstance(c, RenewLeaseCommand)][:2]
    assert [(c.targets, c.cohort) for c in again] == [(["w0"], False), (["w0"], False)]


class LookRecordingFrontend(ListingFrontend):
    """Lists what any agent holds; remembers who held the model at the first look."""

    first_look: list[str] | None = None

    async def wait_listed(self, model: str, timeout_s: float) -> float:
        if self.first_look is None:
            self.first_look = sorted(w for w, a in self.agents.items() if model in a.adapters)
        return await super().wait_listed(model, timeout_s)


async def test_the_frontend_is_looked_at_once_one_member_loaded_while_another_still_loads(
    open_fleet: OpenFleet,
) -> None:
    # w2 misses the first load command and loads only when it is sent again:
    # the listing, a union over workers, is looked for before that.
    fleet = await open_fleet({"w2": Script(lose_first=frozenset({Phase.LOAD}))})
    frontend = LookRecordingFrontend(fleet.agents)
    fleet.frontend = frontend
    result = (await fleet.runner().run(PLAN)).result

    assert result.committed, result.error
    assert frontend.first_look is not None
    assert frontend.first_look and "w2" not in frontend.first_look, frontend.first_look
    assert all(a.adapters == ["policy-v1"] for a in fleet.agents.values())


async def test_a_partial_quorum_commits_without_the_member_that_failed(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet({"w2": Script(fail_load=True)})
    result = (await fleet.runner(quorum=0.75).run(PLAN)).result

    assert result.committed, result.error
    assert result.rank_map is not None
    assert [e.worker_id for e in result.rank_map.entries] == ["w0", "w1"]
    assert "cannot load policy-v1" in _error_of(result, "w2")
    _nobody_paused(fleet)


async def test_without_a_quorum_no_engine_is_paused(open_fleet: OpenFleet) -> None:
    fleet = await open_fleet()
    runner = fleet.runner(expected_world_size=100, quorum_timeout_s=1)
    result = (await runner.run(PLAN)).result

    assert result.error is not None and result.error.code is ErrorCode.QUORUM_TIMEOUT
    assert "sum to 7, which is short of the expected 100" in result.error.message
    assert all(not a.received for a in fleet.agents.values())


async def test_pause_leases_are_renewed_while_the_pause_lasts(open_fleet: OpenFleet) -> None:
    fleet = await open_fleet({"w1": Script(silent=frozenset({Phase.LOAD}))})
    result = (await fleet.runner(pause_lease_s=1.5, phase_timeout_s=3).run(PLAN)).result

    assert result.error is not None and result.error.code is ErrorCode.PHASE_TIMEOUT
    w0 = fleet.agents["w0"]
    pause = next(c for c in w0.received if isinstance(c, PauseCommand))
    renewals = [c for c in w0.received if isinstance(c, RenewLeaseCommand)]
    assert pause.lease_s == 1.5
    assert renewals and all(r.lease_s == 1.5 and r.cohort for r in renewals)
    _nobody_paused(fleet)
