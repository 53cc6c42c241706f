"""SIGKILL of the leading coordinator mid-update: a standby takes over, rolls the
update back, resumes every engine, and answers the requester's retry.

Two ``lorabus coordinator`` processes and three ``lorabus agent`` processes run
against a simulated fleet whose loads take seconds, so the kill lands while
every engine is paused and loading.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from nats.aio.msg import Msg
from processes import Processes, wait_live_workers

from lorabus.bus.connect import close, connect
from lorabus.client import UpdateClient
from lorabus.schemas import Subjects, heartbeat_decoder
from lorabus.simfleet import SimFleet
from lorabus.testbed.child_processes import ChildProcess

WORLD_SIZES = {"w000": 2, "w001": 1, "w002": 4}
LEADER_LEASE_S = 1.0
#: Deadlines only, so that a stuck fleet fails the test instead of hanging it.
DEADLINE_S = 30.0
#: Well under the agents' first periodic read of the fleet state (30-60 s).
ANNOUNCE_DEADLINE_S = 15.0


@pytest.fixture
async def sim(start_sim: Callable[..., Awaitable[SimFleet]]) -> SimFleet:
    return await start_sim(WORLD_SIZES)


async def _start_fleet(
    processes: Processes, sim: SimFleet, nats_url: str, fleet_name: str
) -> dict[str, ChildProcess]:
    return await processes.start_failover_fleet(
        sim, WORLD_SIZES, fleet=fleet_name, nats_url=nats_url, leader_lease_s=LEADER_LEASE_S
    )


async def test_a_standby_rolls_back_the_update_of_a_killed_leader_and_answers_its_retry(
    processes: Processes,
    sim: SimFleet,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    coordinators = await _start_fleet(processes, sim, nats_url, fleet_name)
    nc = await connect(nats_url, name="test-orchestrator")
    try:
        client = UpdateClient(nc, fleet_name)
        before = await wait_live_workers(client, WORLD_SIZES, processes=processes)
        leader, standby = before.leader, ({"c1", "c2"} - {before.leader}).pop()
        for worker in sim.workers.values():
            worker.set_faults(latency_s={"load": 3.0})

        path = make_adapter(1)
        first_try = asyncio.create_task(
            client.update("policy", path, version=1, update_id="step-1", timeout_s=3)
        )
        await asyncio.wait_for(
            asyncio.gather(
                *(w.wait_until(lambda w=w: w.loads_received >= 1) for w in sim.workers.values())
            ),
            DEADLINE_S,
        )
        assert all(worker.paused for worker in sim.workers.values())
        await coordinators[leader].kill()
        unanswered = await first_try
        retried = await client.update(
            "policy", path, version=1, update_id="step-1", timeout_s=DEADLINE_S
        )
        after = await client.status()
    finally:
        await close(nc)

    assert unanswered.error is not None and unanswered.error.code == "timeout"
    assert retried.status == "failed"
    assert retried.error is not None and retried.error.code == "failover"
    assert (after.leader, after.epoch) == (standby, before.epoch + 1)
    for worker in sim.workers.values():
        assert not worker.paused, worker.worker_id
        assert "policy-v1" not in worker.adapters, worker.worker_id


async def test_after_a_failover_the_new_leader_commits_updates(
    processes: Processes,
    sim: SimFleet,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    coordinators = await _start_fleet(processes, sim, nats_url, fleet_name)
    nc = await connect(nats_url, name="test-orchestrator")
    try:
        client = UpdateClient(nc, fleet_name)
        before = await wait_live_workers(client, WORLD_SIZES, processes=processes)
        first = await client.update("policy", make_adapter(1), version=1, timeout_s=DEADLINE_S)
        await coordinators[before.leader].kill()
        second = await client.update("policy", make_adapter(2), timeout_s=DEADLINE_S)
    finally:
        await close(nc)

    assert first.committed, first.error
    assert second.committed, second.error
    assert second.version == 2, "the successor read the committed version from the store"
    for worker in sim.workers.values():
        assert {"policy-v1", "policy-v2"} <= set(worker.adapters)


async def test_a_new_leader_announces_its_epoch_to_every_agent_at_once(
    processes: Processes,
    sim: SimFleet,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    coordinators = await _start_fleet(processes, sim, nats_url, fleet_name)
    nc = await connect(nats_url, name="test-orchestrator")
    epochs_seen: dict[str, int] = {}
    changed = asyncio.Event()

    async def on_heartbeat(msg: Msg) -> None:
        beat = heartbeat_decoder.decode(msg.data)
        epochs_seen[beat.worker_id] = beat.epoch_seen
        changed.set()

    try:
        client = UpdateClient(nc, fleet_name)
        before = await wait_live_workers(client, WORLD_SIZES, processes=processes)
        first = await client.update("policy", make_adapter(1), version=1, timeout_s=DEADLINE_S)
        await nc.subscribe(Subjects(fleet=fleet_name).heartbeat_any(), cb=on_heartbeat)
        await coordinators[before.leader].kill()

        # No update runs: only the new term's announcement can carry its epoch
        # to the agents before their once-a-minute read of the fleet state.
        new_epoch = before.epoch + 1
        async with asyncio.timeout(ANNOUNCE_DEADLINE_S):
            while not all(epochs_seen.get(w) == new_epoch for w in WORLD_SIZES):
                changed.clear()
                await changed.wait()
    finally:
        await close(nc)

    assert first.committed, first.error
    assert {w: epochs_seen[w] for w in WORLD_SIZES} == dict.fromkeys(WORLD_SIZES, new_epoch)
