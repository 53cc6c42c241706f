"""Agents refuse commands of an older epoch and resume engines whose pause lease ran out.

A hand-played coordinator (a plain NATS client in the test) sends the commands,
so each rule is tested on its own against a real agent and a real bus.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from hand_coordinator import DEADLINE_S, EPOCH, HandCoordinator

from lorabus.schemas import (
    CommandRefused,
    LeaseExpired,
    PauseCommand,
    RenewLeaseCommand,
)
from lorabus.testbed.stack import EmbeddedStack


@pytest.fixture
async def stack(
    make_stack: Callable[..., EmbeddedStack],
) -> AsyncIterator[EmbeddedStack]:
    # A long leader lease: the hand's leader record deposes the stack's
    # coordinator, which must not take the fleet back (at a higher epoch)
    # while a test runs.
    async with make_stack([1], leader_lease_s=120) as s:
        yield s


def _pause(update_id: str, epoch: int = EPOCH, lease_s: float = 0.0) -> PauseCommand:
    return PauseCommand(
        update_id=update_id, targets=["w000"], budget_s=5, epoch=epoch, lease_s=lease_s
    )


async def test_a_command_from_an_older_epoch_is_refused_and_reported(
    stack: EmbeddedStack, hand: HandCoordinator
) -> None:
    assert stack.sim is not None
    await hand.send(_pause("new-term"))
    accepted = await asyncio.wait_for(hand.acks.get(), DEADLINE_S)
    await hand.send(_pause("old-term", epoch=EPOCH - 1))
    refused = await asyncio.wait_for(hand.acks.get(), DEADLINE_S)
    event = await hand.next_event(CommandRefused)

    assert accepted.ok
    assert not refused.ok and refused.error is not None and refused.error.code == "fenced"
    assert isinstance(event, CommandRefused)
    assert (event.update_id, event.epoch, event.epoch_seen) == ("old-term", EPOCH - 1, EPOCH)
    pauses = [r for r in stack.sim.workers["w000"].requests if r.path.endswith("pause_generation")]
    assert len(pauses) == 1


async def test_a_pause_whose_lease_runs_out_is_resumed_by_the_agent(
    stack: EmbeddedStack, hand: HandCoordinator
) -> None:
    assert stack.sim is not None
    await hand.send(_pause("abandoned", lease_s=0.5))
    assert (await asyncio.wait_for(hand.acks.get(), DEADLINE_S)).ok
    event = await hand.next_event(LeaseExpired)

    assert isinstance(event, LeaseExpired) and event.resumed
    assert event.update_id == "abandoned"
    assert not stack.sim.workers["w000"].paused


async def test_renewals_keep_the_engine_paused_until_they_stop(
    stack: EmbeddedStack, hand: HandCoordinator
) -> None:
    assert stack.sim is not None
    worker = stack.sim.workers["w000"]
    # A renewal every 0.2 s of a 2 s lease: one may come late and still be in time.
    await hand.send(_pause("long-load", lease_s=2.0))
    assert (await asyncio.wait_for(hand.acks.get(), DEADLINE_S)).ok
    for _ in range(20):  # two leases' worth of renewals
        await hand.send(
            RenewLeaseCommand(
                update_id="long-load", targets=["w000"], budget_s=0, epoch=EPOCH, lease_s=2.0
            )
        )
        await asyncio.sleep(0.2)
        assert worker.paused, "a renewed lease must not run out"
    expired = await hand.next_event(LeaseExpired)

    assert isinstance(expired, LeaseExpired) and expired.resumed
    assert not worker.paused


async def test_the_coordinators_renewals_hold_a_pause_longer_than_its_lease(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    # Loads take four leases: only the renewals the coordinator broadcasts to
    # the pause's cohort keep each engine paused until the update's resume.
    # A lease of a second leaves a renewal (one every third of it) room to be late.
    async with make_stack([1, 2], pause_lease_s=1.0) as stack:
        assert stack.client is not None and stack.sim is not None
        for worker in stack.sim.workers.values():
            worker.set_faults(latency_s={"load": 4.0})
        result = await stack.client.update("policy", make_adapter(1), version=1)

        assert result.committed, result.error
        for worker in stack.sim.workers.values():
            paths = [r.path for r in worker.requests]
            after_pause = paths[paths.index("/engine/pause_generation") :]
            resumes = [p for p in after_pause if p.endswith("resume_generation")]
            assert len(resumes) == 1, (worker.worker_id, after_pause)
            assert not worker.paused
