"""A pause the engine did not answer may land after it was given up, and
after the lease it armed would have run out: that lease runs longer by the
engine's call timeout, so the agent's resumes at every beat outlast it.

The real agent on the in-memory bus under looptime's fake clock; the pause
that lands late is the engine's own state flipped, as a slow engine
carrying out the dead process's request would."""

from __future__ import annotations

import asyncio

import pytest
from memory_fleet import HEARTBEAT_S, InMemoryFleet

from lorabus.agents import Agent, CommandExecutor

pytestmark = pytest.mark.looptime

LATE_S = 10.0


async def _restart_knowing_late_pauses(fleet: InMemoryFleet, worker_id: str) -> None:
    """Restart ``worker_id``'s agent as one that knows a pause may land up to
    ``LATE_S`` after it was given up (the memory fleet's agents do not)."""
    await fleet.kill_agent(worker_id)
    engine = fleet.engines[worker_id]
    agent = Agent(
        fleet.subjects,
        CommandExecutor(worker_id, fleet.world_sizes[worker_id], engine),
        heartbeat_s=HEARTBEAT_S,
        late_pause_s=LATE_S,
    )
    ready = asyncio.Event()
    fleet._start(agent.run(fleet.server.connect(f"{worker_id}-2"), ready))  # type: ignore[arg-type]
    await asyncio.wait_for(ready.wait(), 30)


async def test_an_unanswered_pause_that_lands_after_its_lease_would_have_ended_is_undone() -> None:
    """The engine does not answer the pause; the update fails and resumes.
    The engine carries the pause out a second after the pause lease would
    have run out: the agent, its lease longer by the engine's call timeout,
    still resumes it within a beat."""
    async with InMemoryFleet({"w0": 1}, phase_timeout_s=2.0, pause_lease_s=5.0) as fleet:
        engine = fleet.engines["w0"]
        await _restart_knowing_late_pauses(fleet, "w0")

        async def unanswered() -> None:
            await asyncio.sleep(3600)

        engine.on_pause = unanswered
        result = await fleet.client().update("policy", "/adapters/policy/1", version=1)
        assert not result.committed, result
        engine.on_pause = None
        await asyncio.sleep(5.0 + 1.0)
        engine.paused = True  # the unanswered pause lands, late
        async with asyncio.timeout(5 * HEARTBEAT_S):
            while engine.paused:  # noqa: ASYNC110
                await asyncio.sleep(HEARTBEAT_S / 4)
