"""A requester that calls ``UpdateClient.update`` once gets its terminal result
across a failover, whatever happened to the leader: frozen (SIGSTOP) while
idle, killed (SIGKILL) with nobody listening for a whole lease, killed or
stopped (SIGTERM, which answers ``not_leader``) in the middle of the update.

Two ``lorabus coordinator`` processes and three ``lorabus agent`` processes run
against a simulated fleet in the test's own process. The client has its
default re-ask interval and patience, and is called once: nothing in the test
asks again for it. Deadlines only make a stuck test fail instead of hanging;
nothing is timed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from processes import Processes, wait_live_workers

from lorabus.bus.connect import close, connect
from lorabus.client import UpdateClient
from lorabus.schemas import ErrorCode, FleetStatus, UpdateResult
from lorabus.simfleet import SimFleet
from lorabus.testbed.child_processes import ChildProcess

WORLD_SIZES = {"w000": 2, "w001": 1, "w002": 4}
LEADER_LEASE_S = 3.0
"""Longer than the 2 s a request used to wait for a coordinator to listen, so
that a request sent just after the leader died finds nobody for a while."""
LOAD_S = 3.0
"""Each engine's load takes this long, so a kill lands while all are loading."""
DEADLINE_S = 60.0
"""The client's own timeout; the test gives up a little later."""
UNANSWERED = {ErrorCode.TIMEOUT, ErrorCode.NO_COORDINATOR, ErrorCode.NOT_LEADER}


@pytest.fixture
async def sim(start_sim: Callable[..., Awaitable[SimFleet]]) -> SimFleet:
    return await start_sim(WORLD_SIZES)


async def _start_fleet(
    processes: Processes, sim: SimFleet, nats_url: str, fleet_name: str
) -> dict[str, ChildProcess]:
    return await processes.start_failover_fleet(
        sim, WORLD_SIZES, fleet=fleet_name, nats_url=nats_url, leader_lease_s=LEADER_LEASE_S
    )


async def _ready(processes: Processes, client: UpdateClient) -> tuple[FleetStatus, str]:
    """The fleet's status once every worker is live, and the standby's name."""
    before = await wait_live_workers(client, WORLD_SIZES, processes=processes)
    return before, ({"c1", "c2"} - {before.leader}).pop()


async def _update_once(client: UpdateClient, path: str, update_id: str) -> UpdateResult:
    """One call of the client, which alone must find whoever leads."""
    return await asyncio.wait_for(
        client.update("policy", path, version=1, update_id=update_id, timeout_s=DEADLINE_S),
        DEADLINE_S + 10,
    )


async def _wait_all_loading(sim: SimFleet) -> None:
    await asyncio.wait_for(
        asyncio.gather(
            *(w.wait_until(lambda w=w: w.loads_received >= 1) for w in sim.workers.values())
        ),
        DEADLINE_S,
    )


def _assert_rolled_back(result: UpdateResult, sim: SimFleet) -> None:
    assert result.status == "failed", result
    assert result.error is not None and result.error.code not in UNANSWERED, result.error
    assert result.error.code == ErrorCode.FAILOVER, result.error
    for worker in sim.workers.values():
        assert not worker.paused, worker.worker_id
        assert "policy-v1" not in worker.adapters, worker.worker_id


async def _kill_frozen(coordinators: dict[str, ChildProcess]) -> None:
    """A frozen leader must not wake up after the test: it would act on an old term."""
    for coordinator in coordinators.values():
        if coordinator.suspended:
            await coordinator.kill()


async def _end(how: str, leader: ChildProcess, processes: Processes) -> None:
    match how:
        case "SIGKILL":
            await leader.kill()
        case "SIGSTOP":
            leader.suspend()
        case "SIGTERM":
            await processes.stop(leader)


async def test_a_request_sent_to_a_frozen_idle_leader_is_committed_by_the_standby(
    processes: Processes,
    sim: SimFleet,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    """The frozen leader still holds its subscription, so the request reaches
    it and nobody else; only asking again reaches the standby once it leads."""
    coordinators = await _start_fleet(processes, sim, nats_url, fleet_name)
    nc = await connect(nats_url, name="test-orchestrator")
    client = UpdateClient(nc, fleet_name)
    try:
        before, standby = await _ready(processes, client)
        coordinators[before.leader].suspend()
        result = await _update_once(client, make_adapter(1), "frozen-1")
        after = await client.status()
    finally:
        await _kill_frozen(coordinators)
        await close(nc)

    assert result.committed, result.error
    assert result.update_id == "frozen-1" and result.adapter == "policy-v1"
    assert (after.leader, after.epoch) == (standby, before.epoch + 1)
    for worker in sim.workers.values():
        assert "policy-v1" in worker.adapters, worker.worker_id
        assert not worker.paused, worker.worker_id


async def test_a_request_sent_just_after_an_idle_leader_was_killed_waits_for_the_standby(
    processes: Processes,
    sim: SimFleet,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    """Nobody listens until the standby has waited out the lease: that is a
    failover in progress, not a fleet without a coordinator."""
    coordinators = await _start_fleet(processes, sim, nats_url, fleet_name)
    nc = await connect(nats_url, name="test-orchestrator")
    client = UpdateClient(nc, fleet_name)
    try:
        before, standby = await _ready(processes, client)
        await coordinators[before.leader].kill()
        result = await _update_once(client, make_adapter(1), "after-kill-1")
        after = await client.status()
    finally:
        await close(nc)

    assert result.committed, result.error
    assert (after.leader, after.epoch) == (standby, before.epoch + 1)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP", "SIGTERM"])
async def test_a_request_whose_leader_ends_mid_update_gets_the_roll_back_result(
    how: str,
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    """Killed or frozen, the leader goes silent; stopped, it answers
    ``not_leader``. Either way the standby rolls the update back and answers
    the next ask with that result."""
    sim = await start_sim(WORLD_SIZES, load_latency_s=LOAD_S)
    coordinators = await _start_fleet(processes, sim, nats_url, fleet_name)
    nc = await connect(nats_url, name="test-orchestrator")
    client = UpdateClient(nc, fleet_name)
    asking: asyncio.Task[UpdateResult] | None = None
    try:
        before, standby = await _ready(processes, client)
        asking = asyncio.create_task(_update_once(client, make_adapter(1), "mid-update-1"))
        await _wait_all_loading(sim)
        assert all(worker.paused for worker in sim.workers.values())
        await _end(how, coordinators[before.leader], processes)
        result = await asking
        assert result.error is None or result.error.code not in UNANSWERED, result.error
        after = await client.status()
    finally:
        if asking is not None and not asking.done():
            asking.cancel()
            await asyncio.gather(asking, return_exceptions=True)
        await _kill_frozen(coordinators)
        await close(nc)

    assert result.update_id == "mid-update-1"
    _assert_rolled_back(result, sim)
    assert (after.leader, after.epoch) == (standby, before.epoch + 1)
