"""A coordinator whose own process stalls (a long garbage collection, a
starved CPU) does not give members up for its own silence: what they sent
meanwhile is read a moment later, and the update commits. A real
nats-server, the real coordinator and agents in this process, which the
test blocks outright."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

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
