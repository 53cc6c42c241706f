"""Prefill and decode workers on a real Dynamo 1.6.1 runtime (the mocker engine
in ``--disaggregation-mode prefill`` and ``decode``, each with the test worker's
LoRA routes, registering adapter cards as Dynamo's vLLM handler does): each
runs a ``lorabus agent --role``, each loads the adapter and is a member of the
update, and the rank map says each member's role.

The canary is off here: Dynamo 1.6.1's frontend answered canaries routed to
these mocker workers by ``prefill_worker_id`` or ``decode_worker_id``
inconsistently (a 400 "Invalid request" at times, or an answer from another
worker), so the canary's routing in disaggregated serving is checked on the
simulated fleet only (tests/test_disaggregated.py).
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from conftest import COORDINATOR_TIMEOUTS, WORLD_SIZES, worker_loras
from processes import Processes, wait_live_workers
from real_fleet import DynamoFleet

from lorabus.agents import AgentConfig
from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from lorabus.schemas import WorkerRole

pytestmark = pytest.mark.real_dynamo

ROLES = {"w000": WorkerRole.PREFILL, "w001": WorkerRole.DECODE, "w002": WorkerRole.DECODE}


async def test_every_prefill_and_decode_worker_loads_and_serves_the_update(
    make_dynamo_fleet: Callable[..., DynamoFleet],
    processes: Processes,
    client: UpdateClient,
    http: httpx.AsyncClient,
    nats_url: str,
    make_adapter: Callable[[int], str],
) -> None:
    dynamo = make_dynamo_fleet({}, modes={w: str(r) for w, r in ROLES.items()})
    fleet = client.subjects.fleet
    coordinator = CoordinatorConfig(
        fleet=fleet,
        frontend_url=dynamo.frontend_url,
        expected_world_size=sum(WORLD_SIZES.values()),
        canary=False,
        **COORDINATOR_TIMEOUTS,
    )
    await processes.start_coordinator(coordinator, nats_url=nats_url)
    for worker_id, role in ROLES.items():
        agent = AgentConfig(
            fleet=fleet,
            worker_id=worker_id,
            system_url=dynamo.system_url(worker_id),
            frontend_url=dynamo.frontend_url,
            frontend_discovery_url=dynamo.rl_url,
            world_size=WORLD_SIZES[worker_id],
            role=role,
            heartbeat_s=0.2,
        )
        await processes.start_agent(agent, nats_url=nats_url)
    await wait_live_workers(client, WORLD_SIZES, processes=processes, deadline_s=30)

    result = await client.update("policy", make_adapter(1), version=1, timeout_s=90)

    assert result.committed, result.error
    assert result.rank_map is not None
    assert {e.worker_id: e.role for e in result.rank_map.entries} == ROLES
    for worker_id in ROLES:
        assert "policy-v1" in await worker_loras(http, dynamo, worker_id), worker_id
