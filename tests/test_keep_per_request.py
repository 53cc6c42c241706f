"""A request may ask how many of its adapter's versions engines keep serving
(async RL with staleness K keeps K + 1): every engine then serves that many
of the adapter's newest versions once it commits, the adapter's others are
retired, and no other adapter's version is ever retired by it.

Against a real nats-server, the simulated HTTP engines, a real agent per
worker and the real coordinator, run with ``--keep 1``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from lorabus.bus.connect import close, connect
from lorabus.coordinator.store import FleetStore
from lorabus.errors import BadRequest
from lorabus.schemas import Subjects
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 15.0


async def _engines_hold(stack: EmbeddedStack, served: set[str]) -> None:
    """Until every engine serves exactly ``served`` (retiring runs after the
    answer); fails after DEADLINE_S with what they hold."""
    assert stack.sim is not None
    workers = list(stack.sim.workers.values())
    try:
        async with asyncio.timeout(DEADLINE_S):
            for worker in workers:
                await worker.wait_until(lambda w=worker: set(w.adapters) == served)
    except TimeoutError:
        held = {w.worker_id: sorted(w.adapters) for w in workers}
        raise AssertionError(f"engines hold {held}, not {sorted(served)}") from None


async def test_a_request_with_keep_3_makes_engines_serve_3_versions_of_that_adapter(
    nats_url: str,
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
    make_adapter: Callable[[int], str],
) -> None:
    async with make_stack([1, 2], keep=1) as stack:
        assert stack.client is not None
        update = stack.client.update
        paths = {version: make_adapter(version) for version in range(1, 7)}
        for version in (1, 2, 3, 4):
            result = await update("policy", paths[version], version=version, keep=3)
            assert result.committed, result.error
        await _engines_hold(stack, {"policy-v2", "policy-v3", "policy-v4"})

        # Another adapter, at the coordinator's --keep 1: its retiring spares policy.
        for version in (1, 2):
            result = await update("critic", make_adapter(10 + version), version=version)
            assert result.committed, result.error
        await _engines_hold(stack, {"policy-v2", "policy-v3", "policy-v4", "critic-v2"})

        result = await update("policy", paths[5], version=5, keep=3)
        assert result.committed, result.error
        await _engines_hold(stack, {"policy-v3", "policy-v4", "policy-v5", "critic-v2"})
        nc = await connect(nats_url, name="test-store-reader")
        try:
            store = await FleetStore.bind(nc, Subjects(fleet=fleet_name))
            point = await store.read_committed("policy")
        finally:
            await close(nc)

        # Without keep, the coordinator's --keep again.
        result = await update("policy", paths[6], version=6)
        assert result.committed, result.error
        await _engines_hold(stack, {"policy-v6", "critic-v2"})

    assert point is not None
    assert [(k.version, k.served_name, k.path) for k in point.kept] == [
        (4, "policy-v4", paths[4]),
        (3, "policy-v3", paths[3]),
    ]
    assert point.committed_at > 0


async def test_keep_is_not_part_of_what_an_update_id_names(
    make_stack: Callable[..., EmbeddedStack], make_adapter: Callable[[int], str]
) -> None:
    """Asked again with another keep, an update id gets its first result, as
    the first request ran it; a keep outside 1 to 64 is refused before it is
    sent."""
    async with make_stack([1], keep=1) as stack:
        assert stack.client is not None and stack.sim is not None
        paths = {version: make_adapter(version) for version in (1, 2)}
        first = await stack.client.update("policy", paths[1], version=1, update_id="s1")
        second = await stack.client.update("policy", paths[2], version=2, update_id="s2", keep=2)
        again = await stack.client.update("policy", paths[2], version=2, update_id="s2", keep=1)
        await _engines_hold(stack, {"policy-v1", "policy-v2"})
        with pytest.raises(BadRequest, match="keep must be 1 to 64"):
            await stack.client.update("policy", paths[2], version=3, keep=0)

    assert first.committed and second.committed, (first.error, second.error)
    assert again == second  # the first run's result, not "already committed"
