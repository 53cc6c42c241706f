"""Updates survive the bus going away: a restarted nats-server, a killed cluster node.

Each test runs its own nats-server(s), since it kills them.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Callable

import pytest

from lorabus.testbed.natsserver import NatsServer, free_port
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 60.0


async def _load_started(stack: EmbeddedStack) -> None:
    assert stack.sim is not None
    await asyncio.gather(
        *(w.wait_until(lambda w=w: w.loads_received >= 1) for w in stack.sim.workers.values())
    )


async def _update_until_terminal(
    stack: EmbeddedStack, path: str, version: int, update_id: str
) -> object:
    """Ask, and ask again with the same id while nobody could answer."""
    assert stack.client is not None
    while True:
        result = await stack.client.update(
            "policy", path, version=version, update_id=update_id, timeout_s=10
        )
        if result.error is None or result.error.code not in (
            "timeout",
            "no_coordinator",
            "not_leader",
        ):
            return result


@pytest.fixture
async def lone_server() -> AsyncIterator[NatsServer]:
    with tempfile.TemporaryDirectory(prefix="lorabus-js-") as store:
        server = NatsServer(store_dir=store)
        await server.start()
        try:
            yield server
        finally:
            server.stop()


async def test_an_update_ends_cleanly_across_a_nats_server_restart(
    lone_server: NatsServer, fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    async with EmbeddedStack(
        [2, 1],
        fleet=fleet_name,
        nats_url=lone_server.url,
        heartbeat_s=0.2,
        phase_timeout_s=15,
        pause_lease_s=10,
    ) as stack:
        assert stack.sim is not None
        for worker in stack.sim.workers.values():
            worker.set_faults(latency_s={"load": 1.5})
        path = make_adapter(1)
        first = asyncio.create_task(_update_until_terminal(stack, path, 1, "across-restart"))
        await asyncio.wait_for(_load_started(stack), DEADLINE_S)
        lone_server.stop()
        await lone_server.start()
        result = await asyncio.wait_for(first, DEADLINE_S)
        for worker in stack.sim.workers.values():
            worker.set_faults(latency_s={})
        after = await asyncio.wait_for(
            _update_until_terminal(stack, make_adapter(2), 2, "after-restart"), DEADLINE_S
        )
        paused = [w.worker_id for w in stack.sim.workers.values() if w.paused]

    assert result.status in ("committed", "failed")  # type: ignore[attr-defined]
    assert after.committed, after.error  # type: ignore[attr-defined]
    assert paused == []


@pytest.fixture
async def cluster() -> AsyncIterator[list[NatsServer]]:
    cluster_ports = [free_port() for _ in range(3)]
    with tempfile.TemporaryDirectory(prefix="lorabus-cluster-") as store:
        nodes = [
            NatsServer(
                store_dir=f"{store}/n{i}",
                name=f"n{i}",
                cluster_port=port,
                routes=[p for p in cluster_ports if p != port],
            )
            for i, port in enumerate(cluster_ports)
        ]
        try:
            await asyncio.gather(*(node.start() for node in nodes))
            yield nodes
        finally:
            for node in nodes:
                node.stop()


async def test_a_three_node_cluster_keeps_working_when_a_node_dies_mid_update(
    cluster: list[NatsServer], fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    urls = ",".join(node.url for node in cluster)
    async with EmbeddedStack(
        [1, 2],
        fleet=fleet_name,
        nats_url=urls,
        heartbeat_s=0.2,
        phase_timeout_s=15,
        pause_lease_s=10,
        kv_replicas=3,
    ) as stack:
        assert stack.sim is not None
        assert (await _update_until_terminal(stack, make_adapter(1), 1, "warm-up")).committed  # type: ignore[attr-defined]
        for worker in stack.sim.workers.values():
            worker.set_faults(latency_s={"load": 1.5})
        during = asyncio.create_task(_update_until_terminal(stack, make_adapter(2), 2, "node-dies"))
        await asyncio.wait_for(_load_started(stack), DEADLINE_S)
        cluster[0].stop()
        result = await asyncio.wait_for(during, DEADLINE_S)
        for worker in stack.sim.workers.values():
            worker.set_faults(latency_s={})
        after = await asyncio.wait_for(
            _update_until_terminal(stack, make_adapter(3), 3, "after-node-died"), DEADLINE_S
        )
        paused = [w.worker_id for w in stack.sim.workers.values() if w.paused]

    assert result.status in ("committed", "failed")  # type: ignore[attr-defined]
    assert after.committed, after.error  # type: ignore[attr-defined]
    assert paused == []
