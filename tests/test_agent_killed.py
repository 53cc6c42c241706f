"""An agent killed in the middle of a load fails the update fast, and the rest resume;
under a partial quorum the others commit without it.

Three agents run as processes (mixed world sizes) and beat every 0.2 s; the
coordinator runs in this process with an 8 s phase timeout. One worker's engine
takes a minute to load; once its load request has arrived, its agent gets
SIGKILL. The coordinator must notice the silence from the missing heartbeats,
fail the update naming that worker (or, with ``quorum`` 0.75, commit without
it), and resume everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from processes import Processes, wait_live_workers

from lorabus.bus.connect import close, connect
from lorabus.client import UpdateClient
from lorabus.coordinator import Coordinator, CoordinatorConfig
from lorabus.schemas import UpdateResult
from lorabus.simfleet import SimFleet

WORLD_SIZES = {"w000": 2, "w001": 1, "w002": 4}
VICTIM = "w001"
PHASE_TIMEOUT_S = 8.0
#: Only a deadline so that a stuck update fails the test instead of hanging it.
RESULT_DEADLINE_S = PHASE_TIMEOUT_S + 4.0


@pytest.fixture
async def sim(start_sim: Callable[..., Awaitable[SimFleet]]) -> SimFleet:
    return await start_sim(WORLD_SIZES)


@pytest.fixture(params=[1.0], ids=lambda q: f"quorum-{q}")
async def coordinator(
    request: pytest.FixtureRequest, nats_url: str, fleet_name: str, sim: SimFleet
) -> AsyncIterator[None]:
    config = CoordinatorConfig(
        fleet=fleet_name,
        frontend_url=sim.url,
        expected_world_size=sum(WORLD_SIZES.values()),
        phase_timeout_s=PHASE_TIMEOUT_S,
        verify_timeout_s=PHASE_TIMEOUT_S,
        quorum_timeout_s=PHASE_TIMEOUT_S,
        quorum=request.param,
    )
    nc = await connect(nats_url, name="test-coordinator")
    ready = asyncio.Event()
    task = asyncio.create_task(Coordinator(config).run(nc, ready), name="coordinator")
    try:
        ready_wait = asyncio.ensure_future(ready.wait())
        await asyncio.wait({task, ready_wait}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        ready_wait.cancel()
        if task.done():
            task.result()
        assert ready.is_set(), "the coordinator did not subscribe within 10s"
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await close(nc)


@pytest.mark.usefixtures("coordinator")
async def test_killed_agent_fails_the_update_by_name_and_the_others_resume(
    processes: Processes,
    sim: SimFleet,
    client: UpdateClient,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    result = await _update_killing_the_victim_mid_load(
        processes, sim, client, nats_url, fleet_name, make_adapter
    )

    assert result.status == "failed"
    assert result.error is not None and VICTIM in result.error.message, result.error
    victim_error = result.workers[VICTIM].error
    assert victim_error is not None and "heartbeat" in victim_error.message, victim_error
    for worker_id, worker in sim.workers.items():
        if worker_id != VICTIM:
            assert not worker.paused, worker_id
            assert result.workers[worker_id].ok, result.workers[worker_id]


@pytest.mark.parametrize("coordinator", [0.75], indirect=True, ids=["quorum-0.75"])
@pytest.mark.usefixtures("coordinator")
async def test_under_a_partial_quorum_the_others_commit_without_a_killed_agent(
    processes: Processes,
    sim: SimFleet,
    client: UpdateClient,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    result = await _update_killing_the_victim_mid_load(
        processes, sim, client, nats_url, fleet_name, make_adapter
    )

    # Its engine cannot be told to resume (its agent is dead): that names it,
    # and does not undo the commit of the others.
    assert result.committed, result.error
    assert result.rank_map is not None
    assert [e.worker_id for e in result.rank_map.entries] == ["w000", "w002"]
    victim_error = result.workers[VICTIM].error
    assert victim_error is not None and "heartbeat" in victim_error.message, victim_error
    for worker_id, worker in sim.workers.items():
        if worker_id != VICTIM:
            assert not worker.paused, worker_id
            assert "policy-v1" in worker.adapters, worker_id


async def _update_killing_the_victim_mid_load(
    processes: Processes,
    sim: SimFleet,
    client: UpdateClient,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> UpdateResult:
    agents = await processes.start_agents(
        WORLD_SIZES, sim.system_url, frontend_url=sim.url, fleet=fleet_name, nats_url=nats_url
    )
    await wait_live_workers(client, WORLD_SIZES, processes=processes)
    victim = sim.workers[VICTIM]
    victim.set_faults(latency_s={"load": 60})

    update = asyncio.create_task(
        client.update("policy", make_adapter(1), version=1, timeout_s=RESULT_DEADLINE_S)
    )
    try:
        load_arrived = victim.wait_until(
            lambda: any(r.method == "POST" and r.path == "/v1/loras" for r in victim.requests)
        )
        assert await asyncio.wait_for(load_arrived, RESULT_DEADLINE_S), "the sim stopped"
        await agents[VICTIM].kill()
        return await asyncio.wait_for(asyncio.shield(update), RESULT_DEADLINE_S)
    finally:
        update.cancel()
