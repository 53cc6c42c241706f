"""Failed updates name the worker and the reason, and resume every engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lorabus.testbed.stack import EmbeddedStack


async def test_one_worker_failing_its_load_fails_the_update_and_everyone_resumes(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([2, 1, 1], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.sim is not None
        stack.sim.workers["w001"].set_faults(fail_next_loads=100)
        result = await stack.client.update("policy", make_adapter(1), version=1)

        assert result.status == "failed"
        assert result.error is not None and result.error.code == "worker_failed"
        assert "w001" in result.error.message
        assert not result.workers["w001"].ok
        assert result.workers["w001"].error is not None
        assert "injected load failure" in result.workers["w001"].error.message
        assert result.workers["w000"].ok and result.workers["w002"].ok
        assert result.rank_map is None
        assert "resume" in result.phases
        assert not any(worker.paused for worker in stack.sim.workers.values())
        assert not any("policy-v1" in worker.adapters for worker in stack.sim.workers.values())


async def test_a_failed_update_is_not_committed(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 1], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.coordinator is not None
        assert (await stack.client.update("policy", make_adapter(1), version=1)).committed
        stack.sim.workers["w000"].set_faults(fail_next_loads=100)  # type: ignore[union-attr]
        assert not (await stack.client.update("policy", make_adapter(2), version=2)).committed

        status = await stack.client.status()
        assert (status.committed_adapter, status.committed_version) == ("policy-v1", 1)


async def test_a_transient_load_failure_is_retried(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 1], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.sim is not None
        stack.sim.workers["w000"].set_faults(fail_next_loads=2)
        result = await stack.client.update("policy", make_adapter(1), version=1)

        assert result.committed, result.error
        loads = [
            r
            for r in stack.sim.workers["w000"].requests
            if (r.method, r.path) == ("POST", "/v1/loras")
        ]
        assert len(loads) == 3


async def test_a_directory_that_is_not_an_adapter_fails_with_the_engines_reason(
    tmp_path: Path,
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    empty = tmp_path / "not-an-adapter"
    empty.mkdir()
    async with make_stack([1, 2], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.sim is not None
        result = await stack.client.update("policy", str(empty), version=1)

        assert result.status == "failed"
        for outcome in result.workers.values():
            assert outcome.error is not None
            assert "adapter_config.json" in outcome.error.message
        assert not any(worker.paused for worker in stack.sim.workers.values())


async def test_a_relative_path_is_refused_before_any_engine_is_touched(
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.sim is not None
        before = len(stack.sim.workers["w000"].requests)  # the agent's own start-up calls
        result = await stack.client.update("policy", "adapters/step_1", version=1)

        assert result.status == "failed"
        assert result.error is not None and result.error.code == "bad_request"
        assert "absolute" in result.error.message
        # GETs are the agent's own quiet-time checks of the engine's adapters.
        calls = stack.sim.workers["w000"].requests[before:]
        assert [(r.method, r.path) for r in calls if r.method != "GET"] == []


async def test_an_older_version_than_the_committed_one_is_refused(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1], phase_timeout_s=10) as stack:
        assert stack.client is not None
        assert (await stack.client.update("policy", make_adapter(5), version=5)).committed
        result = await stack.client.update("policy", make_adapter(4), version=4)

        assert result.error is not None and result.error.code == "stale_version"
        assert "committed version 5" in result.error.message


async def test_quorum_not_reached_is_a_clear_error_and_pauses_nothing(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack(
        [2, 1], phase_timeout_s=10, expected_world_size=8, quorum_timeout_s=1.0
    ) as stack:
        assert stack.client is not None and stack.sim is not None
        before = {w.worker_id: len(w.requests) for w in stack.sim.workers.values()}
        result = await stack.client.update("policy", make_adapter(1), version=1)

        assert result.status == "failed"
        assert result.error is not None and result.error.code == "quorum_timeout"
        assert "sum to 3" in result.error.message and "expected 8" in result.error.message
        assert not any(
            r.path.startswith("/engine/")
            for w in stack.sim.workers.values()
            for r in w.requests[before[w.worker_id] :]
        )
