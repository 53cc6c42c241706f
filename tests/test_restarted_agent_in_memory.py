"""An agent killed and started again with the same worker id (a pod restart,
an OOM kill, a crash loop) right before an update: the restarted agent takes
its place, and the update reaches it instead of failing. The real agents and
coordinator, in memory under looptime (memory_fleet.py); a real SIGKILL of an
agent process against a real nats-server is in test_agent_killed.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
from memory_fleet import HEARTBEAT_S, InMemoryFleet

pytestmark = pytest.mark.looptime

WORLD_SIZES = {"w0": 1, "w1": 2, "w2": 1}
OpenFleet = Callable[..., Awaitable[InMemoryFleet]]


@pytest.fixture
async def open_fleet() -> AsyncIterator[OpenFleet]:
    async with AsyncExitStack() as stack:

        async def open_(**settings: Any) -> InMemoryFleet:
            return await stack.enter_async_context(InMemoryFleet(WORLD_SIZES, **settings))

        yield open_


@pytest.mark.parametrize("gap_beats", [0, 1, 2, 4])
async def test_an_agent_restarted_just_before_an_update_costs_it_nothing(
    open_fleet: OpenFleet, gap_beats: int
) -> None:
    """Killed, started again ``gap_beats`` beats later, and the update asked
    for as soon as the new agent is up (it has reconciled by then): each of
    ten rounds commits, on every member, the restarted one included."""
    fleet = await open_fleet()
    client = fleet.client()
    results = []
    for version in range(1, 11):
        await fleet.kill_agent("w2")
        await asyncio.sleep(gap_beats * HEARTBEAT_S)
        await fleet.start_agent("w2", WORLD_SIZES["w2"])
        results.append(
            await client.update(
                "policy",
                f"/adapters/policy/{version}",
                version=version,
                update_id=f"u{version}",
                timeout_s=120,
            )
        )

    failed = [(r.update_id, r.error) for r in results if not r.committed]
    assert failed == []
    assert all(
        r.rank_map is not None and [e.worker_id for e in r.rank_map.entries] == ["w0", "w1", "w2"]
        for r in results
    )
    assert "policy-v10" in fleet.engines["w2"].adapters
    assert not any(engine.paused for engine in fleet.engines.values())


@pytest.mark.parametrize("phase", ["pause", "load"])
async def test_an_agent_restarted_during_an_update_costs_it_nothing(
    open_fleet: OpenFleet, phase: str
) -> None:
    """Killed while its engine pauses or loads (the engine left as it was),
    started again at once: the update reaches the new agent and commits on
    every member, and no engine is left paused."""
    fleet = await open_fleet()
    client = fleet.client()
    assert (await client.update("policy", "/adapters/policy/1", version=1, timeout_s=120)).committed
    engine = fleet.engines["w2"]
    reached = asyncio.Event()

    async def slow() -> None:
        reached.set()
        await asyncio.sleep(5)

    setattr(engine, f"on_{phase}", slow)
    update = asyncio.ensure_future(
        client.update("policy", "/adapters/policy/2", version=2, update_id="u2", timeout_s=120)
    )
    await asyncio.wait_for(reached.wait(), 60)
    await fleet.kill_agent("w2")
    setattr(engine, f"on_{phase}", None)
    await fleet.start_agent("w2", WORLD_SIZES["w2"])
    result = await update

    assert result.committed, result.error
    assert "policy-v2" in engine.adapters
    assert not any(e.paused for e in fleet.engines.values())
