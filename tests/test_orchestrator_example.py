"""The orchestrator example (examples/rl_orchestrator.py) does what it says, against
a real fleet: publishes steps, samples from the served name, gets each worker's
broadcast ranks from its own world size, and re-publishing a step is harmless."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from lorabus import LorabusError
from lorabus.testbed.stack import EmbeddedStack

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "rl_orchestrator.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rl_orchestrator", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_example_publishes_steps_and_samples_the_served_policy(
    make_adapter: Callable[[int], str], make_stack: Callable[..., EmbeddedStack]
) -> None:
    example = _example()
    async with make_stack([2, 4, 1]) as stack:
        assert stack.client is not None and stack.sim is not None
        publisher = example.PolicyPublisher(stack.client, adapter="policy", run_id="run7")

        first_rebuild = await publisher.publish(1, make_adapter(1))
        ranks = publisher.broadcast_ranks()
        reply = await publisher.rollout(stack.sim.url, "hello")
        step_2 = make_adapter(2)
        second_rebuild = await publisher.publish(2, step_2)
        again = await publisher.publish(2, step_2)  # as a restarted orchestrator would
        pauses = sum(
            w.count_requests("POST", "/engine/pause_generation") for w in stack.sim.workers.values()
        )
        with pytest.raises(LorabusError) as refused:  # the same step, other content
            await publisher.publish(2, make_adapter(3))
        with pytest.raises(ValueError, match="older than the published step 2"):
            await publisher.publish(1, step_2)

    assert first_rebuild is True and second_rebuild is False and again is False
    assert ranks == {"w000": range(1, 3), "w001": range(3, 7), "w002": range(7, 8)}
    assert reply, "the frontend answered a rollout for the served name"
    assert publisher.served_name == "policy-v2"
    assert pauses == 2 * 3, "step 2 published twice paused the fleet once"
    assert refused.value.code == "bad_request"
