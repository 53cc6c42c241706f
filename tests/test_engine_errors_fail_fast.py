"""An engine's final refusal fails a load at once; only transient failures are retried.

Every engine of an update waits paused while any load is retried, so asking
again is worth it only when the answer may change: no answer, a 5xx, a
directory the shared filesystem does not show yet. A directory the engine read
and found no adapter in (vLLM's "No adapter found for <path>"), or a 4xx, gets
the same answer every time. Real NATS, real agents and coordinator, and the
simulated Dynamo fleet over real HTTP; the loads are counted where the engine
received them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from lorabus.schemas import ErrorCode
from lorabus.testbed.stack import EmbeddedStack


def _loads(stack: EmbeddedStack) -> dict[str, int]:
    assert stack.sim is not None
    return {wid: worker.loads_received for wid, worker in stack.sim.workers.items()}


def _not_an_adapter(tmp_path: Path) -> Path:
    """A directory a trainer might leave behind: files, but no adapter_config.json."""
    directory = tmp_path / "step_7"
    directory.mkdir()
    (directory / "README.md").write_text("no adapter here\n")
    return directory


async def test_a_directory_without_adapter_config_is_tried_once_and_fails_naming_the_worker(
    tmp_path: Path, make_stack: Callable[..., EmbeddedStack]
) -> None:
    directory = _not_an_adapter(tmp_path)
    async with make_stack([1, 2], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.sim is not None
        before = _loads(stack)

        result = await stack.client.update("policy", str(directory), version=1)

        assert result.status == "failed"
        assert result.error is not None and result.error.code == ErrorCode.WORKER_FAILED
        after = _loads(stack)
        for worker_id, worker in stack.sim.workers.items():
            assert after[worker_id] - before[worker_id] == 1, (worker_id, worker.requests)
            assert worker_id in result.error.message, result.error
            outcome = result.workers[worker_id]
            assert not outcome.ok and outcome.error is not None, outcome
            assert outcome.error.code == ErrorCode.ENGINE_ERROR, outcome.error
            assert f"No adapter found for {directory}" in outcome.error.message, outcome.error
            assert "not retried" in outcome.error.message, outcome.error
            assert not worker.paused, worker_id
            assert "policy-v1" not in worker.adapters, worker_id
        assert "resume" in result.phases
        status = await stack.client.status()
        assert status.committed_adapter is None
        assert [m.paused for m in status.members] == [False, False]


async def test_a_client_error_from_the_engine_is_not_retried(
    make_adapter: Callable[[int], str], make_stack: Callable[..., EmbeddedStack]
) -> None:
    # A 404 on /v1/loras is a worker without the route: asking again cannot help.
    async with make_stack([1, 1], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.sim is not None
        refusing = stack.sim.workers["w000"]
        refusing.set_faults(fail_next_loads=1, load_failure_status=404)
        before = _loads(stack)

        result = await stack.client.update("policy", make_adapter(1), version=1)

        assert result.status == "failed"
        assert result.error is not None and "w000" in result.error.message, result.error
        error = result.workers["w000"].error
        assert error is not None and "answered 404" in error.message, error
        assert "not retried" in error.message, error
        assert _loads(stack)["w000"] - before["w000"] == 1, refusing.requests
        assert result.workers["w001"].ok
        assert not any(worker.paused for worker in stack.sim.workers.values())


@pytest.mark.parametrize("status", [503, 500])
async def test_a_transient_load_failure_is_retried_and_the_update_commits(
    status: int, make_adapter: Callable[[int], str], make_stack: Callable[..., EmbeddedStack]
) -> None:
    async with make_stack([1, 1], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.sim is not None
        stack.sim.workers["w000"].set_faults(fail_next_loads=1, load_failure_status=status)
        before = _loads(stack)

        result = await stack.client.update("policy", make_adapter(1), version=1)

        assert result.committed, result.error
        after = _loads(stack)
        assert after["w000"] - before["w000"] == 2, stack.sim.workers["w000"].requests
        assert after["w001"] - before["w001"] == 1
        for worker in stack.sim.workers.values():
            assert "policy-v1" in worker.adapters and not worker.paused


async def test_a_directory_the_filesystem_shows_late_is_retried_until_it_loads(
    tmp_path: Path, make_adapter: Callable[[int], str], make_stack: Callable[..., EmbeddedStack]
) -> None:
    # A shared filesystem can show a fresh step directory late: Dynamo answers
    # 500 "Local LoRA not found" until it appears, and that is worth asking again.
    late = tmp_path / "late" / "step_1"
    late.parent.mkdir()
    written = Path(make_adapter(1))
    async with make_stack([1], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.sim is not None
        worker = stack.sim.workers["w000"]
        before = worker.loads_received
        update = stack.client.update("policy", str(late), version=1)

        async def appear_after_the_first_load() -> None:
            await worker.wait_until(lambda: worker.loads_received > before)
            await asyncio.to_thread(written.rename, late)

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(appear_after_the_first_load())
            pending = tasks.create_task(update)

        result = pending.result()
        assert result.committed, result.error
        assert worker.loads_received - before >= 2, worker.requests
        assert "policy-v1" in worker.adapters and not worker.paused
