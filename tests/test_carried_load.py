"""A pause carries its update's load: the agent loads right behind its own
engine's pause, and never on an engine whose pause did not hold.

A hand-played coordinator sends the commands over a real nats-server to a
real agent, whose engine is a simulated Dynamo worker over real HTTP; what
the worker received is read from its request log.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from hand_coordinator import EPOCH, HandCoordinator, real_agent

from lorabus.agents import AgentConfig
from lorabus.schemas import (
    ErrorCode,
    LoadCommand,
    LoadSpec,
    PauseCommand,
    Phase,
    ResumeCommand,
    acks_in,
)
from lorabus.simfleet import SimFleet, SimWorker

WORKER = "w000"
NAME = "policy-v1"


@pytest.fixture
async def worker(
    nats_url: str,
    fleet_name: str,
    hand: HandCoordinator,
    start_sim: Callable[..., Awaitable[SimFleet]],
) -> AsyncIterator[SimWorker]:
    """The simulated engine of one real agent on the test's fleet."""
    sim = await start_sim({WORKER: 1})
    await hand.lead(EPOCH)
    config = AgentConfig(
        fleet=fleet_name, worker_id=WORKER, system_url=sim.system_url(WORKER), heartbeat_s=0.2
    )
    async with real_agent(nats_url, config, sim, "test-carried-load-agent") as engine:
        yield engine


def _pause(update_id: str, path: str, budget_s: float = 5, hold_s: float = 0.0) -> PauseCommand:
    return PauseCommand(
        update_id=update_id,
        targets=[WORKER],
        budget_s=budget_s,
        epoch=EPOCH,
        lease_s=30,
        then_load=LoadSpec(served_name=NAME, path=path, budget_s=5, ack_hold_s=hold_s),
    )


def _engine_calls(engine: SimWorker) -> list[str]:
    return [r.path for r in engine.requests if r.method == "POST"]


async def test_a_pause_that_carries_its_load_loads_right_behind_the_engines_pause(
    hand: HandCoordinator, worker: SimWorker, make_adapter: Callable[[int], str]
) -> None:
    update_id = f"u-{uuid.uuid4().hex[:8]}"
    await hand.send(_pause(update_id, make_adapter(1)))

    paused = await hand.next_ack(update_id)
    loaded = await hand.next_ack(update_id)

    assert (paused.phase, paused.ok) == (Phase.PAUSE, True)
    assert (loaded.phase, loaded.ok) == (Phase.LOAD, True), loaded.error
    assert NAME in loaded.adapters and loaded.paused
    calls = _engine_calls(worker)
    assert calls.index("/engine/pause_generation") < calls.index("/v1/loras"), calls
    assert worker.paused and NAME in worker.adapters

    await hand.send(ResumeCommand(update_id=update_id, targets=[WORKER], budget_s=5, epoch=EPOCH))
    assert (await hand.next_ack(update_id)).ok
    assert not worker.paused


async def test_a_quick_load_acks_its_pause_inside_its_own_ack(
    hand: HandCoordinator, worker: SimWorker, make_adapter: Callable[[int], str]
) -> None:
    """Asked to hold the pause's ack, the agent sends one message for both:
    the first ack to come is the load's, and it stands for an ok pause."""
    update_id = f"u-{uuid.uuid4().hex[:8]}"
    await hand.send(_pause(update_id, make_adapter(1), hold_s=5))

    loaded = await hand.next_ack(update_id)
    await hand.send(ResumeCommand(update_id=update_id, targets=[WORKER], budget_s=5, epoch=EPOCH))
    resumed = await hand.next_ack(update_id)

    assert (loaded.phase, loaded.ok, loaded.with_pause) == (Phase.LOAD, True, True), loaded
    paused, _ = acks_in(loaded)
    assert (paused.phase, paused.ok, paused.paused) == (Phase.PAUSE, True, True)
    assert paused.duration_s == loaded.pause_s > 0
    assert resumed.phase is Phase.RESUME and resumed.ok, "a pause ack came after the load's"
    calls = _engine_calls(worker)
    assert calls.index("/engine/pause_generation") < calls.index("/v1/loras"), calls


async def test_a_load_running_past_the_hold_gets_its_pause_acked_on_its_own_first(
    hand: HandCoordinator, worker: SimWorker, make_adapter: Callable[[int], str]
) -> None:
    """So that the coordinator, which re-sends a pause not acked within twice
    the hold, learns that the engine paused while its load goes on."""
    worker.set_faults(latency_s={"load": 3.0})
    update_id = f"u-{uuid.uuid4().hex[:8]}"
    await hand.send(_pause(update_id, make_adapter(1), hold_s=0.2))

    paused = await hand.next_ack(update_id)
    still_loading = NAME not in worker.adapters
    loaded = await hand.next_ack(update_id)

    assert (paused.phase, paused.ok) == (Phase.PAUSE, True)
    assert still_loading, "the pause was acked only once its load had ended"
    assert (loaded.phase, loaded.ok, loaded.with_pause) == (Phase.LOAD, True, False), loaded


@pytest.mark.parametrize("hold_s", [0.0, 5.0], ids=["acked at once", "asked to hold"])
async def test_the_load_of_a_pause_that_failed_is_refused_and_never_reaches_the_engine(
    hold_s: float, hand: HandCoordinator, worker: SimWorker, make_adapter: Callable[[int], str]
) -> None:
    worker.set_faults(hang=True)  # the engine answers nothing: the pause times out
    update_id = f"u-{uuid.uuid4().hex[:8]}"
    await hand.send(_pause(update_id, make_adapter(1), budget_s=0.5, hold_s=hold_s))

    paused = await hand.next_ack(update_id)
    worker.set_faults(hang=False)
    loaded = await hand.next_ack(update_id)

    assert (paused.phase, paused.ok) == (Phase.PAUSE, False)
    assert loaded.phase is Phase.LOAD and not loaded.ok
    assert loaded.error is not None and loaded.error.code is ErrorCode.NOT_PAUSED
    assert "/v1/loras" not in _engine_calls(worker)
    assert NAME not in worker.adapters


def _lone_load(update_id: str, path: str) -> LoadCommand:
    """A load sent on its own, as the coordinator re-sends one to a straggler."""
    return LoadCommand(
        update_id=update_id,
        targets=[WORKER],
        budget_s=5,
        epoch=EPOCH,
        served_name=NAME,
        path=path,
        after_pause=True,
    )


async def test_a_load_for_a_pause_this_agent_has_not_taken_is_refused(
    hand: HandCoordinator, worker: SimWorker, make_adapter: Callable[[int], str]
) -> None:
    # The coordinator re-sends a load only to a member that acked its pause: an
    # agent without that pause restarted, and its engine is not paused.
    update_id = f"u-{uuid.uuid4().hex[:8]}"
    await hand.send(_lone_load(update_id, make_adapter(1)))

    refused = await hand.next_ack(update_id)

    assert refused.phase is Phase.LOAD and not refused.ok
    assert refused.error is not None and refused.error.code is ErrorCode.NOT_PAUSED
    assert "has not taken that pause" in refused.error.message
    assert "/v1/loras" not in _engine_calls(worker)
    assert not worker.paused


async def test_a_load_sent_again_while_the_carried_one_runs_loads_once(
    hand: HandCoordinator, worker: SimWorker, make_adapter: Callable[[int], str]
) -> None:
    worker.set_faults(latency_s={"load": 0.5})
    update_id = f"u-{uuid.uuid4().hex[:8]}"
    path = make_adapter(1)
    await hand.send(_pause(update_id, path))
    await hand.send(_lone_load(update_id, path))  # queued behind, or answered

    acks = [await hand.next_ack(update_id) for _ in range(2)]
    assert [(a.phase, a.ok) for a in acks] == [(Phase.PAUSE, True), (Phase.LOAD, True)]
    await hand.send(_lone_load(update_id, path))  # after it ran: the same ack again
    again = await hand.next_ack(update_id)

    assert again == acks[1]
    assert _engine_calls(worker).count("/v1/loras") == 1


async def test_a_resume_that_comes_before_the_carried_load_starts_goes_first(
    hand: HandCoordinator, worker: SimWorker, make_adapter: Callable[[int], str]
) -> None:
    # The update ended while this engine was still pausing (another member's
    # pause failed it): its resume must not wait behind the load.
    worker.set_faults(latency_s={"pause": 0.5})
    update_id = f"u-{uuid.uuid4().hex[:8]}"
    await hand.send(_pause(update_id, make_adapter(1)))
    await hand.send(ResumeCommand(update_id=update_id, targets=[WORKER], budget_s=5, epoch=EPOCH))

    acks = {a.phase: a for a in [await hand.next_ack(update_id) for _ in range(3)]}

    assert acks[Phase.PAUSE].ok and acks[Phase.RESUME].ok
    refused = acks[Phase.LOAD]
    assert not refused.ok and refused.error is not None
    assert refused.error.code is ErrorCode.NOT_PAUSED
    assert "resume came first" in refused.error.message
    assert "/v1/loras" not in _engine_calls(worker)
    assert not worker.paused
