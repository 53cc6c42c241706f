"""One update at a time per fleet; newer queued versions supersede older ones."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lorabus.testbed.stack import EmbeddedStack


async def test_queued_older_versions_are_superseded_and_updates_never_overlap(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 2]) as stack:
        assert stack.client is not None and stack.sim is not None
        slow = stack.sim.workers["w000"]
        slow.set_faults(latency_s={"load": 0.5})
        before = len(slow.requests)  # the agent's own start-up calls
        first = asyncio.create_task(stack.client.update("policy", make_adapter(1), version=1))
        await asyncio.wait_for(slow.wait_until(lambda: slow.loads_received == 1), 10)

        second = asyncio.create_task(stack.client.update("policy", make_adapter(2), version=2))
        third = asyncio.create_task(stack.client.update("policy", make_adapter(3), version=3))
        results = await asyncio.wait_for(asyncio.gather(first, second, third), 30)

        assert [r.status for r in results] == ["committed", "failed", "committed"]
        assert results[1].error is not None and results[1].error.code == "superseded"
        engine_calls = [r.path for r in slow.requests[before:] if r.path.startswith("/engine/")]
        assert engine_calls == ["/engine/pause_generation", "/engine/resume_generation"] * 2


async def test_the_same_update_id_sent_twice_at_once_runs_once(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1]) as stack:
        assert stack.client is not None and stack.sim is not None
        path = make_adapter(1)
        results = await asyncio.gather(
            stack.client.update("policy", path, version=1, update_id="twice"),
            stack.client.update("policy", path, version=1, update_id="twice"),
        )

        assert results[0] == results[1] and results[0].committed
        assert stack.sim.workers["w000"].loads_received == 1
