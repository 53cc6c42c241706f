"""Agents refuse commands of an older epoch and resume engines whose pause lease ran out.

A hand-played coordinator (a plain NATS client in the test) sends the commands,
so each rule is tested on its own against a real agent and a real bus.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from hand_coordinator import DEADLINE_S, HandCoordinator

from lorabus.bus import close, connect
from lorabus.stack import EmbeddedStack
from schemas import (
    CommandRefused,
    LeaseExpired,
    PauseCommand,
    RenewLeaseCommand,
    Subjects,
)

#: Above the epoch of the stack's own coordinator, so the agent accepts us.
EPOCH = 100


@pytest.fixture
async def stack(nats_url: str, fleet_name: str) -> AsyncIterator[EmbeddedStack]:
    async with EmbeddedStack([1], fleet=fleet_name, nats_url=nats_url, heartbeat_s=0.2) as s:
        yield s


@pytest.fixture
async def hand(nats_url: str, fleet_name: str) -> AsyncIterator[HandCoordinator]:
    nc = await connect(nats_url, name="test-hand-coordinator")
    coordinator = HandCoordinator(nc, Subjects(fleet=fleet_name))
    await coordinator.start()
    yield coordinator
    await close(nc)


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
    await hand.send(_pause("long-load", lease_s=1.0))
    assert (await asyncio.wait_for(hand.acks.get(), DEADLINE_S)).ok
    for _ in range(10):  # two leases' worth of renewals
        await hand.send(
            RenewLeaseCommand(
                update_id="long-load", targets=["w000"], budget_s=0, epoch=EPOCH, lease_s=1.0
            )
        )
        await asyncio.sleep(0.2)
        assert worker.paused, "a renewed lease must not run out"
    expired = await hand.next_event(LeaseExpired)

    assert isinstance(expired, LeaseExpired) and expired.resumed
    assert not worker.paused
