"""A coordinator whose own process stalls (a long garbage collection, a
starved CPU) does not give members up for its own silence: what they sent
meanwhile is read a moment later, and the update commits. A real
nats-server, the real coordinator and agents in this process, which the
test blocks outright.

The end-to-end proof of the deadline rule (``coordinator/deadline.py``),
whose every case ``test_phase_deadline.py`` runs on a made-up clock and in
memory under looptime. What only these show: that what a stall holds up
(the heartbeats in the first test, an ack in the second) really waits in
the connection, and is read within the tick the rule gives it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from lorabus.agents.bus import AgentBus
from lorabus.schemas import Ack
from lorabus.testbed.stack import EmbeddedStack

BEAT_S = 0.2
STALL_S = 1.5
"""Over seven of the agents' beat periods: every member looks silent for
more than the three beats that make it gone."""
LOAD_S = 2.0
DEADLINE_S = 30.0


async def test_a_stall_of_the_coordinators_process_gives_up_no_member(
    make_adapter: Callable[[int], str], make_stack: Callable[..., EmbeddedStack]
) -> None:
    async with make_stack([1, 2], heartbeat_s=BEAT_S) as stack:
        assert stack.client is not None and stack.sim is not None
        workers = list(stack.sim.workers.values())
        for worker in workers:
            worker.set_faults(latency_s={"load": LOAD_S})
        asking = asyncio.create_task(stack.client.update("policy", make_adapter(1), version=1))
        async with asyncio.timeout(DEADLINE_S):
            await asyncio.gather(*(w.wait_until(lambda w=w: w.paused) for w in workers))
        time.sleep(STALL_S)  # noqa: ASYNC251 - the stall under test: nothing of this process runs
        result = await asyncio.wait_for(asking, DEADLINE_S)

    assert result.committed, result.error


PHASE_S = 1.0
"""The pause's budget; the load it carries has twice that from the pause's start."""
QUICK_LOAD_S = 0.3
PAST_EVERY_DEADLINE_S = 2 * PHASE_S + 0.5


async def test_a_stall_past_a_phases_deadline_reads_the_acks_sent_before_it(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The member acked well before the phase's deadline, and the process
    stalled until after it: the ack is read before the member is called
    missing. The stall starts in the agent as its ack is handed to its
    connection (this process is the coordinator's too), so the ack goes out,
    and is read, once the process runs again, past the deadline."""
    send_ack = AgentBus.publish_ack
    stalled: list[Ack] = []

    async def send_then_stall(bus: AgentBus, ack: Ack) -> None:
        await send_ack(bus, ack)
        if ack.phase == "load" and not stalled:
            stalled.append(ack)
            time.sleep(PAST_EVERY_DEADLINE_S)  # noqa: ASYNC251 - the stall under test

    monkeypatch.setattr(AgentBus, "publish_ack", send_then_stall)
    async with make_stack(
        [2], heartbeat_s=BEAT_S, phase_timeout_s=PHASE_S, leader_lease_s=30.0
    ) as stack:
        assert stack.client is not None and stack.sim is not None
        for worker in stack.sim.workers.values():
            worker.set_faults(latency_s={"load": QUICK_LOAD_S})
        result = await asyncio.wait_for(
            stack.client.update("policy", make_adapter(1), version=1), DEADLINE_S
        )

    assert [ack.ok for ack in stalled] == [True]
    assert result.committed, result.error
