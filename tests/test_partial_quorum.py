"""Below a full quorum, an update commits without the workers that failed, names
them, leaves them out of the rank map, and they catch up on their own."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 15.0


async def test_a_partial_quorum_commits_without_the_failed_worker_until_it_catches_up(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 1, 2], quorum=0.75) as stack:
        assert stack.client is not None and stack.sim is not None
        straggler = stack.sim.workers["w000"]
        straggler.set_faults(fail_next_loads=1000)
        result = await stack.client.update("policy", make_adapter(1), version=1)

        assert result.committed, result.error
        assert result.rank_map is not None
        assert [(e.worker_id, e.rank_offset) for e in result.rank_map.entries] == [
            ("w001", 1),
            ("w002", 2),
        ]
        assert result.rank_map.world_size == 4
        assert not result.workers["w000"].ok and result.workers["w000"].error is not None
        assert result.workers["w001"].ok and result.workers["w002"].ok
        assert "policy-v1" not in straggler.adapters
        assert not any(worker.paused for worker in stack.sim.workers.values())

        straggler.set_faults(fail_next_loads=0)
        await asyncio.wait_for(
            straggler.wait_until(lambda: "policy-v1" in straggler.adapters), DEADLINE_S
        )


async def test_a_partial_quorum_still_fails_when_too_few_workers_succeed(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 1, 2], quorum=0.75) as stack:
        assert stack.client is not None and stack.sim is not None
        stack.sim.workers["w002"].set_faults(fail_next_loads=1000)  # half the world size
        result = await stack.client.update("policy", make_adapter(1), version=1)

        assert result.status == "failed"
        assert result.error is not None and "w002" in result.error.message
        assert not any("policy-v1" in w.adapters for w in stack.sim.workers.values())


async def test_a_worker_whose_first_pause_failed_is_left_out_then_takes_part_again(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 1, 2], quorum=0.75, phase_timeout_s=2) as stack:
        assert stack.client is not None and stack.sim is not None
        refuser = stack.sim.workers["w000"]
        refuser.set_faults(hang=True)  # its engine answers nothing: the pause times out
        first = await stack.client.update("policy", make_adapter(1), version=1)

        assert first.committed, first.error
        assert first.rank_map is not None
        assert [e.worker_id for e in first.rank_map.entries] == ["w001", "w002"]
        assert not first.workers["w000"].ok
        assert "policy-v1" not in refuser.adapters

        refuser.set_faults(hang=False)
        second = await stack.client.update("policy", make_adapter(2), version=2)

        assert second.committed, second.error
        assert second.rank_map is not None
        assert [e.worker_id for e in second.rank_map.entries] == ["w000", "w001", "w002"]
        assert all(outcome.ok for outcome in second.workers.values()), second.workers
        assert "policy-v2" in refuser.adapters
        assert not any(worker.paused for worker in stack.sim.workers.values())
