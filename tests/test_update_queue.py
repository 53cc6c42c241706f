"""One update at a time per fleet; newer queued versions supersede older ones.

The real agents and the real coordinator run on the in-memory bus
(``memory_fleet.py``) under looptime's fake clock: the queue is the
coordinator's logic, not NATS's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack

import pytest
from memory_fleet import InMemoryFleet

pytestmark = pytest.mark.looptime

DEADLINE_S = 30.0


@pytest.fixture
async def open_fleet() -> AsyncIterator[Callable[[], Awaitable[InMemoryFleet]]]:
    """Opens the fleet inside the test: looptime fakes the clock of the test
    only, and a fleet started in a fixture would keep the real one."""
    async with AsyncExitStack() as stack:

        async def open_() -> InMemoryFleet:
            return await stack.enter_async_context(InMemoryFleet({"w0": 1, "w1": 2}))

        yield open_


def _adapter(step: int) -> str:
    return f"/adapters/policy/step_{step}"


async def test_queued_older_versions_are_superseded_and_updates_never_overlap(
    open_fleet: Callable[[], Awaitable[InMemoryFleet]],
) -> None:
    fleet = await open_fleet()
    client = fleet.client()
    slow = fleet.engines["w0"]
    before = len(slow.calls)  # the agent's own start-up calls
    loading, release = asyncio.Event(), asyncio.Event()

    async def held() -> None:
        loading.set()
        await release.wait()

    slow.on_load = held
    first = asyncio.create_task(client.update("policy", _adapter(1), version=1))
    await asyncio.wait_for(loading.wait(), DEADLINE_S)

    second = asyncio.create_task(client.update("policy", _adapter(2), version=2))
    async with asyncio.timeout(DEADLINE_S):
        while fleet.coordinator.book.queued < 1:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    third = asyncio.create_task(client.update("policy", _adapter(3), version=3))
    await asyncio.wait_for(asyncio.wait([second]), DEADLINE_S)
    assert not first.done(), "the second was answered while the first still loads"
    release.set()
    results = await asyncio.wait_for(asyncio.gather(first, second, third), DEADLINE_S)

    assert [r.status for r in results] == ["committed", "failed", "committed"]
    assert results[1].error is not None and results[1].error.code == "superseded"
    engine_calls = [call for call in slow.calls[before:] if call in ("pause", "resume")]
    assert engine_calls == ["pause", "resume"] * 2


async def test_the_same_update_id_sent_twice_at_once_runs_once(
    open_fleet: Callable[[], Awaitable[InMemoryFleet]],
) -> None:
    fleet = await open_fleet()
    client = fleet.client()
    path = _adapter(1)
    results = await asyncio.gather(
        client.update("policy", path, version=1, update_id="twice"),
        client.update("policy", path, version=1, update_id="twice"),
    )

    assert results[0] == results[1] and results[0].committed
    assert fleet.engines["w0"].calls.count("load") == 1
