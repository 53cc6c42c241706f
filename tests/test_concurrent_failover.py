"""Two adapters' updates in flight at once when the leader is killed: the
standby finds both in-flight records and rolls each back, and each requester,
having called ``UpdateClient.update`` once, gets its own terminal result.

Two ``lorabus coordinator`` processes (live mode) and three ``lorabus agent``
processes against a simulated fleet whose loads take seconds, so that the
kill lands while both updates run. Deadlines only make a stuck test fail.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from processes import Processes, wait_live_workers

from lorabus.bus.connect import close, connect
from lorabus.client import UpdateClient
from lorabus.schemas import ErrorCode, UpdateMode, UpdateResult
from lorabus.simfleet import SimFleet

WORLD_SIZES = {"w000": 2, "w001": 1, "w002": 4}
LEADER_LEASE_S = 3.0
LOAD_S = 3.0
DEADLINE_S = 60.0
ADAPTERS = ("alpha", "beta")


async def test_a_leader_killed_with_two_adapters_in_flight_is_rolled_back_for_each(
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    sim = await start_sim(WORLD_SIZES, load_latency_s=LOAD_S)
    coordinators = await processes.start_failover_fleet(
        sim,
        WORLD_SIZES,
        fleet=fleet_name,
        nats_url=nats_url,
        leader_lease_s=LEADER_LEASE_S,
        mode=UpdateMode.LIVE,
    )
    nc = await connect(nats_url, name="test-orchestrators")
    client = UpdateClient(nc, fleet_name)
    asking: list[asyncio.Task[UpdateResult]] = []
    try:
        before = await wait_live_workers(client, WORLD_SIZES, processes=processes)
        asking = [
            asyncio.create_task(
                client.update(
                    adapter,
                    make_adapter(step),
                    version=1,
                    update_id=f"{adapter}-1",
                    timeout_s=DEADLINE_S,
                )
            )
            for step, adapter in enumerate(ADAPTERS, start=1)
        ]
        async with asyncio.timeout(DEADLINE_S):
            while len((await client.status()).running) < 2:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        await coordinators[before.leader].kill()
        results = await asyncio.wait_for(asyncio.gather(*asking), DEADLINE_S + 10)
        after = await client.status()
    finally:
        for task in asking:
            task.cancel()
        await asyncio.gather(*asking, return_exceptions=True)
        await close(nc)

    for adapter, result in zip(ADAPTERS, results, strict=True):
        assert result.update_id == f"{adapter}-1"
        assert result.error is not None and result.error.code == ErrorCode.FAILOVER, result
    assert after.leader != before.leader and after.epoch == before.epoch + 1
    assert after.running == []
    for worker in sim.workers.values():
        # The loads queued behind the kill ran, then the roll-backs' unloads.
        withdrawn = worker.wait_until(
            lambda w=worker: not {"alpha-v1", "beta-v1"} & set(w.adapters)
        )
        assert await asyncio.wait_for(withdrawn, DEADLINE_S), worker.worker_id
