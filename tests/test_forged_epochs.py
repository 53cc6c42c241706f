"""An agent adopts a higher epoch only when the fleet's leader record shows it:
a command that claims one is neither obeyed nor able to fence out the leader."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from events import EventListener
from hand_coordinator import EPOCH, HandCoordinator

from lorabus.bus.connect import close, connect
from lorabus.schemas import (
    CommandRefused,
    Event,
    PauseCommand,
    Subjects,
    encode,
)
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 15.0
PAUSE = "/engine/pause_generation"


async def test_a_forged_high_epoch_is_refused_and_the_leader_keeps_commanding(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    subjects = Subjects(fleet=fleet_name)
    async with make_stack([1, 2]) as stack:
        assert stack.client is not None and stack.sim is not None
        first = await stack.client.update("policy", make_adapter(1), version=1)
        assert first.committed, first.error
        pauses_before = {
            w: [r.path for r in worker.requests].count(PAUSE)
            for w, worker in stack.sim.workers.items()
        }
        attacker = await connect(nats_url, name="test-attacker")
        listener = EventListener(attacker, subjects)
        await listener.start()
        try:
            for worker_id in ("w000", "w001"):
                forged = PauseCommand(
                    update_id="forged",
                    targets=[worker_id],
                    budget_s=5,
                    epoch=1_000_000,
                    lease_s=0,
                )
                await attacker.publish(subjects.cmd_worker(worker_id), encode(forged))
            refused = [
                e
                for e in await listener.wait_for(CommandRefused, 2)
                if isinstance(e, CommandRefused)
            ]
        finally:
            await close(attacker)

        second = await stack.client.update("policy", make_adapter(2), version=2)
        status = await stack.client.status()
        pauses_after = {
            w: [r.path for r in worker.requests].count(PAUSE)
            for w, worker in stack.sim.workers.items()
        }

    assert {r.worker_id for r in refused} == {"w000", "w001"}
    assert all(r.epoch == 1_000_000 and "leader record" in r.reason for r in refused)
    assert second.committed, "the real leader must not be fenced out by a forged epoch"
    # The only pauses since are the real update's, one per engine.
    assert {w: pauses_after[w] - pauses_before[w] for w in pauses_after} == {"w000": 1, "w001": 1}
    assert not any(m.paused for m in status.members)


async def test_a_new_leaders_command_that_beats_its_record_is_obeyed_without_a_resend(
    nats_url: str, fleet_name: str, make_stack: Callable[..., EmbeddedStack], hand: HandCoordinator
) -> None:
    """The agent read the leader record a moment before a new leader wrote it;
    the new leader's pause then looks unproven. It must be checked again once
    the record can be read, not dropped until a re-send (the hand sends once)."""
    subjects = Subjects(fleet=fleet_name)
    async with make_stack([1]) as stack:
        assert stack.sim is not None
        await hand.lead(EPOCH)
        forged = PauseCommand(
            update_id="forged", targets=["w000"], budget_s=5, epoch=1_000_000, lease_s=1
        )
        await hand.nc.publish(subjects.cmd_worker("w000"), encode(forged))
        # Refused right after the agent read the record: reads are spaced out,
        # so the record written next is not read again at once.
        refusal = await hand.next_event(CommandRefused)
        await hand.lead(EPOCH + 1)
        await hand.send(
            PauseCommand(
                update_id="new-leader", targets=["w000"], budget_s=5, epoch=EPOCH + 1, lease_s=1
            )
        )
        ack = await hand.next_ack("new-leader")
        refused_later = [e for e in _drain(hand.events) if isinstance(e, CommandRefused)]

    assert isinstance(refusal, CommandRefused) and refusal.update_id == "forged"
    assert ack.ok and ack.epoch == EPOCH + 1, ack
    assert [r.update_id for r in refused_later if r.update_id == "new-leader"] == []


def _drain(queue: asyncio.Queue[Event]) -> list[Event]:
    events = []
    while not queue.empty():
        events.append(queue.get_nowait())
    return events
