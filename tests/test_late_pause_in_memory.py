"""A pause whose answer never came, that the engine carries out after its
agent gave up on it (an HTTP call that times out on the client may still
complete on the server). The real agents and coordinator in memory, under
looptime; the chaos suite checks the same on real processes.
"""

from __future__ import annotations

import asyncio

import pytest
from memory_fleet import InMemoryFleet

pytestmark = pytest.mark.looptime

LANDS_AFTER_S = 3.0
PAUSE_LEASE_S = 60.0


async def test_a_pause_that_lands_after_its_agent_gave_up_is_undone_and_reported() -> None:
    """w1's pause call gets no answer within the phase; the update fails and
    w1 is resumed; then the engine carries the pause out. Its agent reports
    the engine as maybe paused meanwhile, and resumes it again well before
    the pause lease would have, instead of leaving it paused, unowned."""
    async with InMemoryFleet(
        {"w0": 1, "w1": 1}, phase_timeout_s=1.0, pause_lease_s=PAUSE_LEASE_S
    ) as fleet:
        engine = fleet.engines["w1"]
        landed = asyncio.Event()

        def land() -> None:
            engine.paused = True
            landed.set()

        async def unanswered() -> None:
            asyncio.get_running_loop().call_later(LANDS_AFTER_S, land)
            await asyncio.sleep(3600)  # no answer: the agent's budget ends first

        engine.on_pause = unanswered
        result = await fleet.client().update(
            "policy", "/adapters/policy/1", version=1, timeout_s=120
        )
        engine.on_pause = None
        reported = fleet.coordinator.membership.live()["w1"].heartbeat.paused
        await asyncio.wait_for(landed.wait(), 60)
        # On looptime's clock: a few beats, far inside the lease.
        await asyncio.sleep(5 * 0.2)
        paused_after = engine.paused

    assert result.status == "failed", result
    assert reported, "the agent reported a maybe-paused engine as running"
    assert not paused_after, "the late pause held the engine until its lease"
