"""Disaggregated serving: every prefill and every decode worker loads the adapter
and is a member of the update (Dynamo #11520, #13068), and the rank map, the
result and the status say each member's role.

The simulated Dynamo fleet plays a prefill worker and a decode worker behind
one frontend, which needs both to hold a model to serve it; real ``lorabus
agent`` processes run with ``--role prefill`` and ``--role decode``, with a
real coordinator on a real nats-server. Each agent's canary is routed to its
worker in its phase (``nvext.prefill_worker_id`` / ``decode_worker_id``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from processes import Processes, wait_live_workers

from lorabus.agents import AgentConfig
from lorabus.audit.render import status_text
from lorabus.client import UpdateClient
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.schemas import ErrorCode, FleetStatus, WorkerRole
from lorabus.simfleet import SimFleet

DEADLINE_S = 30.0
ROLES = {"p000": WorkerRole.PREFILL, "d000": WorkerRole.DECODE}


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    roles = [str(role) for role in ROLES.values()]
    async with SimFleet(list(ROLES), [1, 2], roles=roles) as fleet:
        yield fleet


@pytest.fixture
async def fleet(
    sim: SimFleet, processes: Processes, client: UpdateClient, nats_url: str
) -> UpdateClient:
    name = client.subjects.fleet
    coordinator = CoordinatorConfig(
        fleet=name,
        frontend_url=sim.url,
        expected_world_size=3,
        phase_timeout_s=20,
        verify_timeout_s=20,
    )
    await processes.start_coordinator(coordinator, nats_url=nats_url)
    for worker_id, role in ROLES.items():
        config = AgentConfig(
            fleet=name,
            worker_id=worker_id,
            system_url=sim.system_url(worker_id),
            frontend_url=sim.url,
            world_size=sim.workers[worker_id].world_size,
            role=role,
            heartbeat_s=0.2,
        )
        await processes.start_agent(config, nats_url=nats_url)
    await wait_live_workers(client, ROLES, processes=processes)
    return client


async def test_prefill_and_decode_workers_each_load_and_prove_it_in_their_phase(
    sim: SimFleet, fleet: UpdateClient, make_adapter: Callable[[int], str]
) -> None:
    result = await fleet.update("policy", make_adapter(1), version=1, timeout_s=DEADLINE_S)

    assert result.committed, result.error
    assert result.rank_map is not None
    assert {e.worker_id: e.role for e in result.rank_map.entries} == ROLES
    for worker in sim.workers.values():
        assert "policy-v1" in worker.adapters, worker.worker_id
    # Each agent's canary named its worker in its own phase.
    ids = {w: sim.workers[w].instance_id for w in ROLES}
    targets = [
        r.body["nvext"]
        for w in ROLES
        for r in sim.workers[w].requests
        if (r.method, r.path) == ("POST", "/v1/completions") and "nvext" in (r.body or {})
    ]
    assert {"prefill_worker_id": ids["p000"], "extra_fields": ["worker_id"]} in targets
    assert {"decode_worker_id": ids["d000"], "extra_fields": ["worker_id"]} in targets
    status = await _status(fleet, lambda s: len(s.members) == 2)
    assert {m.worker_id: m.role for m in status.members} == ROLES
    assert "(prefill)" in status_text(status) and "(decode)" in status_text(status)


async def test_a_prefill_worker_that_does_not_serve_the_version_fails_the_update(
    sim: SimFleet, fleet: UpdateClient, make_adapter: Callable[[int], str]
) -> None:
    sim.workers["p000"].set_faults(unroutable=["policy-v1"])

    result = await fleet.update("policy", make_adapter(1), version=1, timeout_s=DEADLINE_S)

    assert not result.committed
    failed = result.workers["p000"].error
    assert failed is not None and failed.code == ErrorCode.CANARY_FAILED
    assert "p000" in failed.message
    # The decode worker cannot serve it either without a prefill worker that does.
    assert not any(w.paused for w in sim.workers.values())
    assert not any("policy-v1" in w.adapters for w in sim.workers.values())


async def _status(client: UpdateClient, until: Callable[[FleetStatus], bool]) -> FleetStatus:
    async with asyncio.timeout(DEADLINE_S):
        while True:
            status = await client.status()
            if until(status):
                return status
            await asyncio.sleep(0.1)
