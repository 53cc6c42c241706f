"""The queue of waiting update requests is bounded, and what need not wait does
not: past ``max_queued`` a request is answered ``busy`` at once, one that a
queued request supersedes ``superseded`` at once, and junk ahead of the
trainer's request costs it no pause.

Each test holds the fleet in a slow load, so "at once" means "while the
running update is still loading"."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lorabus.client import UpdateClient
from lorabus.schemas import ErrorCode, UpdateResult
from lorabus.simfleet.state import SimWorker
from lorabus.testbed.stack import EmbeddedStack

SLOW_LOAD_S = 6.0
DEADLINE_S = 30.0


def _code(result: UpdateResult) -> str | None:
    return None if result.error is None else str(result.error.code)


def _pauses(worker: SimWorker) -> int:
    return worker.count_requests("POST", "/engine/pause_generation")


async def _hold_in_a_slow_load(
    client: UpdateClient, worker: SimWorker, adapter: str, path: str, version: int
) -> asyncio.Task[UpdateResult]:
    """Start an update whose load takes SLOW_LOAD_S; return once it is loading.
    Later loads are fast again."""
    worker.set_faults(latency_s={"load": SLOW_LOAD_S})
    loads = worker.loads_received
    running = asyncio.create_task(client.update(adapter, path, version=version))
    await asyncio.wait_for(worker.wait_until(lambda: worker.loads_received > loads), 10)
    worker.set_faults(latency_s={})
    return running


async def test_past_max_queued_a_request_is_answered_busy_at_once_and_may_come_again(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1], max_queued=2) as stack:
        client, sim = stack.client, stack.sim
        assert client is not None and sim is not None
        worker = sim.workers["w000"]
        path = make_adapter(1)
        running = await _hold_in_a_slow_load(client, worker, "policy", path, 1)
        queued = [
            asyncio.create_task(client.update(name, path, version=1, update_id=f"{name}-1"))
            for name in ("alpha", "beta")
        ]
        await _wait_queued(stack, 2)
        busy = await client.update("gamma", path, version=1, update_id="gamma-1")
        assert not running.done(), "answered while the running update still loads"
        re_asked = await asyncio.wait_for(
            client.update("alpha", path, version=1, update_id="alpha-1"), DEADLINE_S
        )
        results = await asyncio.wait_for(asyncio.gather(running, *queued), DEADLINE_S)
        busy_again = await client.update("gamma", path, version=1, update_id="gamma-1")

    assert _code(busy) == ErrorCode.BUSY, busy
    assert busy.error is not None and "ask again later" in busy.error.message
    assert all(r.committed for r in results), results
    assert re_asked == results[1], "a queued request asked again is no new request"
    assert busy_again.committed, "busy kept nothing: the same id ran when asked again"


async def test_a_request_a_queued_one_supersedes_is_answered_at_once(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1]) as stack:
        client, sim = stack.client, stack.sim
        assert client is not None and sim is not None
        worker = sim.workers["w000"]
        running = await _hold_in_a_slow_load(client, worker, "policy", make_adapter(1), 1)
        newer = asyncio.create_task(client.update("policy", make_adapter(3), version=3))
        await _wait_queued(stack, 1)
        older = await client.update("policy", make_adapter(2), version=2)
        assert not running.done(), "answered while the running update still loads"
        results = await asyncio.wait_for(asyncio.gather(running, newer), DEADLINE_S)

    assert _code(older) == ErrorCode.SUPERSEDED, older
    assert [r.version for r in results if r.committed] == [1, 3]


async def test_junk_ahead_of_the_trainers_request_costs_it_no_pause(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    """Ten requests arrive while an update runs, then the trainer's: the junk
    is answered at once (invalid, stale, already committed, or superseded by a
    newer version), and the trainer's update is the only pause after it."""
    step_1 = make_adapter(1)
    async with make_stack([1], adapter_roots=[step_1.rsplit("/", 1)[0]]) as stack:
        client, sim = stack.client, stack.sim
        assert client is not None and sim is not None
        worker = sim.workers["w000"]
        assert (await client.update("policy", step_1, version=1)).committed
        running = await _hold_in_a_slow_load(client, worker, "policy", make_adapter(2), 2)
        pauses = _pauses(worker)

        junk = [
            ("policy", "relative/step_9", 9),
            ("../policy", make_adapter(9), 9),
            ("policy", "/etc", 9),
            ("policy", step_1, 0),
            ("policy", step_1, 1),
            ("policy", make_adapter(8), 1),
        ]
        at_once = [await client.update(a, p, version=v) for a, p, v in junk]
        # Each older version is answered as the next arrives; the last by the trainer's.
        older = [
            asyncio.create_task(client.update("policy", make_adapter(v), version=v))
            for v in (3, 4, 5, 6)
        ]
        superseded = await asyncio.wait_for(asyncio.gather(*older[:3]), DEADLINE_S)
        await _wait_queued(stack, 1)
        trainer = asyncio.create_task(client.update("policy", make_adapter(7), version=7))
        superseded.append(await asyncio.wait_for(older[3], DEADLINE_S))
        assert not running.done(), "the junk was answered while the running update loads"
        assert (await asyncio.wait_for(running, DEADLINE_S)).committed
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
    assert _pauses(worker) == pauses + 1, "one pause after the running one: the trainer's"


async def _wait_queued(stack: EmbeddedStack, count: int) -> None:
    """Wait until ``count`` requests wait in the coordinator's queue. The tasks
    that send them publish when the event loop gets to them, so the queue is
    looked at until it holds them (a deadline only to fail instead of hang)."""
    assert stack.coordinator is not None
    async with asyncio.timeout(15):
        while stack.coordinator.book.queued < count:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    assert stack.coordinator.book.queued == count
