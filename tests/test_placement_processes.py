"""Placement with a worker killed for real: every part a process of its own.

A ``lorabus coordinator`` (live mode, ``--replace-after 2``) and four ``lorabus
agent`` processes with ``--label zone=...`` over simulated workers. An
adapter placed on one zone-a worker commits there only; that worker's agent
gets SIGKILL; the leader moves the adapter to the other zone-a worker, whose
engine loads it, and never to zone b; the next version lands there too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from processes import Processes, wait_live_workers

from lorabus.agents.config import AgentConfig
from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from lorabus.schemas import UpdateMode
from lorabus.simfleet import SimFleet

ZONES = {"w000": "a", "w001": "a", "w002": "b", "w003": "b"}
WORLD_SIZES = dict.fromkeys(ZONES, 1)
REPLACE_AFTER_S = 2.0
#: Only deadlines, so that a stuck step fails the test instead of hanging it.
DEADLINE_S = 30.0


async def test_a_killed_placed_worker_is_replaced_by_one_of_its_selector(
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
    client: UpdateClient,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    sim = await start_sim(WORLD_SIZES)
    config = CoordinatorConfig(
        fleet=fleet_name,
        frontend_url=sim.url,
        expected_world_size=len(ZONES),
        mode=UpdateMode.LIVE,
        replace_after_s=REPLACE_AFTER_S,
        quorum_timeout_s=10,
    )
    await processes.start_coordinator(config, nats_url=nats_url)
    agents = {
        worker: await processes.start_agent(
            AgentConfig(
                fleet=fleet_name,
                worker_id=worker,
                system_url=sim.system_url(worker),
                frontend_url=sim.url,
                heartbeat_s=0.2,
                labels=[f"zone={zone}"],
            ),
            nats_url=nats_url,
        )
        for worker, zone in ZONES.items()
    }
    await wait_live_workers(client, WORLD_SIZES, processes=processes)

    first = await client.update(
        "policy", make_adapter(1), version=1, replicas=1, selector={"zone": "a"}
    )
    assert first.committed, first.error
    (placed,) = first.workers
    other = "w001" if placed == "w000" else "w000"
    assert placed in ("w000", "w001")
    assert [w for w, s in sim.workers.items() if "policy-v1" in s.adapters] == [placed]

    await agents[placed].kill()
    async with asyncio.timeout(DEADLINE_S):
        await sim.workers[other].wait_until(lambda: "policy-v1" in sim.workers[other].adapters)
        while [a.placed for a in (await client.status()).adapters] != [[other]]:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
    assert all("policy-v1" not in sim.workers[w].adapters for w in ("w002", "w003"))

    second = await client.update(
        "policy", make_adapter(2), version=2, replicas=1, selector={"zone": "a"}
    )
    assert second.committed and list(second.workers) == [other], second
    assert "policy-v2" in sim.workers[other].adapters
