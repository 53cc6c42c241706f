"""Each tenant's own adapter store, on a real nats-server: what a tenant
pushes goes there and serves from there; an agent of an older wire version,
which could not fetch from it, keeps such updates from running.

(The server's permissions around each store, and quotas of bytes, under
``lorabus auth init``: test_tenants_secure.py and test_store_roles.py; the
sweep of every store: test_store_sweep.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lorabus.schemas import TENANT_STORES_SINCE, ErrorCode, Heartbeat, encode
from lorabus.schemas.tenants import Tenant
from lorabus.testbed.stack import EmbeddedStack


async def test_a_tenants_adapter_serves_from_its_own_store_and_old_agents_hold_it_back(
    make_stack: Callable[..., EmbeddedStack], make_adapter: Callable[[int], str]
) -> None:
    async with make_stack([1, 1], tenants={"a": Tenant(adapters="a-*")}) as stack:
        assert stack.client is not None and stack.sim is not None
        a = await stack.client_as("a")
        digest = await a.push_adapter(make_adapter(1))
        done = await a.update("a-policy", digest=digest, version=1, timeout_s=30)
        assert done.committed, done.error
        assert done.path == f"bus:a/{digest}"
        assert all("a-policy-v1" in w.adapters for w in stack.sim.workers.values())
        # The fleet's own store does not hold it.
        shared = await stack.client.update("policy", digest=digest, version=1, timeout_s=30)
        assert shared.error is not None and shared.error.code == ErrorCode.BAD_REQUEST

        # An agent of wire version 8 beats: a's next version waits for none
        # of it, and is refused, naming it.
        old = Heartbeat(
            v=TENANT_STORES_SINCE - 1,
            worker_id="w9",
            world_size=1,
            engine="dynamo",
            adapters=[],
            paused=False,
            interval_s=0.2,
        )
        stop = asyncio.Event()

        async def beat() -> None:
            while not stop.is_set():
                await stack.client.nc.publish(stack.client.subjects.heartbeat("w9"), encode(old))
                await asyncio.sleep(0.2)

        beating = asyncio.create_task(beat())
        try:
            await asyncio.sleep(0.5)
            digest2 = await a.push_adapter(make_adapter(2))
            refused = await a.update("a-policy", digest=digest2, version=2, timeout_s=30)
            assert refused.error is not None and refused.error.code == ErrorCode.BAD_REQUEST
            assert "w9" in refused.error.message and "wire version" in refused.error.message
        finally:
            stop.set()
            await beating
