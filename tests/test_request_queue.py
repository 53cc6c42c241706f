"""The queue of waiting update requests is bounded, and what need not wait does
not: past ``max_queued`` a request is answered ``busy`` at once, one that a
queued request supersedes ``superseded`` at once, and junk ahead of the
trainer's request costs it no pause.

Each test holds the fleet in a load until the answers that must come at once
have come, so "at once" means "while the running update is still loading".
The real agent and the real coordinator run on the in-memory bus
(``memory_fleet.py``) under looptime's fake clock: the queue is the
coordinator's logic, not NATS's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import pytest
from memory_fleet import InMemoryFleet

from lorabus.client import UpdateClient
from lorabus.schemas import ErrorCode, UpdateResult

pytestmark = pytest.mark.looptime

ROOT = "/adapters/policy"
DEADLINE_S = 30.0
OpenFleet = Callable[..., Any]


def _adapter(step: int) -> str:
    return f"{ROOT}/step_{step}"


def _code(result: UpdateResult) -> str | None:
    return None if result.error is None else str(result.error.code)


@pytest.fixture
async def open_fleet() -> AsyncIterator[OpenFleet]:
    async with AsyncExitStack() as stack:

        async def open_(**settings: Any) -> InMemoryFleet:
            return await stack.enter_async_context(InMemoryFleet({"w0": 1}, **settings))

        yield open_


@dataclass
class _Held:
    running: asyncio.Task[UpdateResult]
    release: asyncio.Event


async def _hold_in_a_load(
    fleet: InMemoryFleet, client: UpdateClient, adapter: str, path: str, version: int
) -> _Held:
    """Start an update whose load waits until released; return once it is
    loading. Later loads do not wait once it is released."""
    loading, release = asyncio.Event(), asyncio.Event()

    async def held() -> None:
        loading.set()
        await release.wait()

    fleet.engines["w0"].on_load = held
    running = asyncio.create_task(client.update(adapter, path, version=version))
    await asyncio.wait_for(loading.wait(), DEADLINE_S)
    return _Held(running, release)


async def test_past_max_queued_a_request_is_answered_busy_at_once_and_may_come_again(
    open_fleet: OpenFleet,
) -> None:
    # One update at a time, so that other adapters' requests queue (the bound
    # per adapter is the book's, tests/test_update_book.py).
    fleet = await open_fleet(max_queued_total=2, max_concurrent=1)
    client = fleet.client()
    path = _adapter(1)
    held = await _hold_in_a_load(fleet, client, "policy", path, 1)
    queued = [
        asyncio.create_task(client.update(name, path, version=1, update_id=f"{name}-1"))
        for name in ("alpha", "beta")
    ]
    await _wait_queued(fleet, 2)
    busy = await client.update("gamma", path, version=1, update_id="gamma-1")
    assert not held.running.done(), "answered while the running update still loads"
    asked = _asks(fleet, "alpha-1")
    re_asked = asyncio.create_task(
        fleet.client().update("alpha", path, version=1, update_id="alpha-1")
    )
    async with asyncio.timeout(DEADLINE_S):
        while _asks(fleet, "alpha-1") == asked:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    assert not held.running.done(), "asked again while the running update still loads"
    held.release.set()
    results = await asyncio.wait_for(asyncio.gather(held.running, *queued), DEADLINE_S)
    re_asked_result = await asyncio.wait_for(re_asked, DEADLINE_S)
    busy_again = await client.update("gamma", path, version=1, update_id="gamma-1")

    assert _code(busy) == ErrorCode.BUSY, busy
    assert busy.error is not None and "ask again later" in busy.error.message
    assert "--max-queued-total" in busy.error.message
    assert all(r.committed for r in results), results
    assert re_asked_result == results[1], "a queued request asked again is no new request"
    assert busy_again.committed, "busy kept nothing: the same id ran when asked again"


async def test_a_request_a_queued_one_supersedes_is_answered_at_once(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet()
    client = fleet.client()
    held = await _hold_in_a_load(fleet, client, "policy", _adapter(1), 1)
    newer = asyncio.create_task(client.update("policy", _adapter(3), version=3))
    await _wait_queued(fleet, 1)
    older = await client.update("policy", _adapter(2), version=2)
    assert not held.running.done(), "answered while the running update still loads"
    held.release.set()
    results = await asyncio.wait_for(asyncio.gather(held.running, newer), DEADLINE_S)

    assert _code(older) == ErrorCode.SUPERSEDED, older
    assert [r.version for r in results if r.committed] == [1, 3]


async def test_junk_ahead_of_the_trainers_request_costs_it_no_pause(
    open_fleet: OpenFleet,
) -> None:
    """Ten requests arrive while an update runs, then the trainer's: the junk
    is answered at once (invalid, stale, already committed, or superseded by a
    newer version), and the trainer's update is the only pause after it."""
    fleet = await open_fleet(adapter_roots=[ROOT])
    client = fleet.client()
    engine = fleet.engines["w0"]
    step_1 = _adapter(1)
    assert (await client.update("policy", step_1, version=1)).committed
    held = await _hold_in_a_load(fleet, client, "policy", _adapter(2), 2)
    pauses = engine.calls.count("pause")

    junk = [
        ("policy", "relative/step_9", 9),
        ("../policy", _adapter(9), 9),
        ("policy", "/etc", 9),
        ("policy", step_1, 0),
        ("policy", step_1, 1),
        ("policy", _adapter(8), 1),
    ]
    at_once = [await client.update(a, p, version=v) for a, p, v in junk]
    # Each older version is answered as the next arrives; the last by the trainer's.
    older = [
        asyncio.create_task(client.update("policy", _adapter(v), version=v)) for v in (3, 4, 5, 6)
    ]
    superseded = await asyncio.wait_for(asyncio.gather(*older[:3]), DEADLINE_S)
    await _wait_queued(fleet, 1)
    trainer = asyncio.create_task(client.update("policy", _adapter(7), version=7))
    superseded.append(await asyncio.wait_for(older[3], DEADLINE_S))
    assert not held.running.done(), "the junk was answered while the running update loads"
    held.release.set()
    assert (await asyncio.wait_for(held.running, DEADLINE_S)).committed
    result = await asyncio.wait_for(trainer, DEADLINE_S)

    assert [_code(r) for r in at_once] == [
        ErrorCode.BAD_REQUEST,
        ErrorCode.BAD_REQUEST,
        ErrorCode.BAD_REQUEST,
        ErrorCode.STALE_VERSION,
        None,
        ErrorCode.BAD_REQUEST,
    ], at_once
    assert at_once[4].committed and at_once[4].version == 1
    assert [_code(r) for r in superseded] == [ErrorCode.SUPERSEDED] * 4
    assert result.committed and result.version == 7, result
    paused_after = engine.calls.count("pause") - pauses
    assert paused_after == 1, "one pause after the running one: the trainer's"


def _asks(fleet: InMemoryFleet, update_id: str) -> int:
    return sum(r.update_id == update_id for r in fleet.requests())


async def _wait_queued(fleet: InMemoryFleet, count: int) -> None:
    """Wait until ``count`` requests wait in the coordinator's queue. The tasks
    that send them publish when the event loop gets to them, so the queue is
    looked at until it holds them (a deadline only to fail instead of hang)."""
    async with asyncio.timeout(15):
        while fleet.coordinator.book.queued < count:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    assert fleet.coordinator.book.queued == count
