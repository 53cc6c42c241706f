"""The canary on a real nats-server, the real agents and coordinator, and the
simulated Dynamo fleet over HTTP: a worker that lists the new version but whose
generations fail (Dynamo #11163) stops the commit, named with its engine's
answer; the version is withdrawn and nothing stays paused. The same fleet with
``--no-canary`` commits, as it did before the canary existed."""

from __future__ import annotations

from collections.abc import Callable

from lorabus.schemas import ErrorCode, UpdateMode
from lorabus.testbed.stack import EmbeddedStack


async def test_a_worker_that_lists_the_version_but_does_not_serve_it_fails_the_update(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 1, 1], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.sim is not None
        stack.sim.workers["w001"].set_faults(unroutable=["policy-v1"])

        result = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)

        assert not result.committed
        assert result.error is not None and result.error.code == ErrorCode.CANARY_FAILED
        failed = result.workers["w001"].error
        assert failed is not None and failed.code == ErrorCode.CANARY_FAILED
        assert "w001" in failed.message and "Model not found" in failed.message
        assert result.workers["w000"].ok and result.workers["w002"].ok
        assert "canary" in result.phases
        for worker in stack.sim.workers.values():
            assert not worker.paused, worker.worker_id
            assert "policy-v1" not in worker.adapters, worker.worker_id
        # Each agent generated on its own worker only (by instance id).
        asked = {
            w: s.count_requests("POST", "/v1/completions") for w, s in stack.sim.workers.items()
        }
        assert asked == {"w000": 1, "w001": 1, "w002": 1}


async def test_live_mode_runs_the_canary_after_the_load_and_commits(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 2], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.sim is not None
        result = await stack.client.update(
            "policy", make_adapter(1), version=1, mode=UpdateMode.LIVE, timeout_s=30
        )

        assert result.committed, result.error
        assert {"load", "verify", "canary"} <= set(result.phases)
        assert "pause" not in result.phases
        # One per agent, and the coordinator's through the frontend on one of them.
        asked = sum(s.count_requests("POST", "/v1/completions") for s in stack.sim.workers.values())
        assert asked == 3


async def test_a_fleet_without_the_canary_commits_what_it_cannot_prove(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 1], phase_timeout_s=10, canary=False) as stack:
        assert stack.client is not None and stack.sim is not None
        stack.sim.workers["w001"].set_faults(unroutable=["policy-v1"])

        result = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)

        assert result.committed, result.error
        assert "canary" not in result.phases
        assert all(
            s.count_requests("POST", "/v1/completions") == 0 for s in stack.sim.workers.values()
        )
