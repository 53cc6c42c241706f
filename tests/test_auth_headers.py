"""Agents and the coordinator send the API key and extra headers on engine calls.

The simulated fleet requires ``Authorization: Bearer s3cret`` on every worker
and frontend route. The coordinator and the agents run as ``lorabus``
processes configured the way an operator would: ``--api-key-env`` naming a
variable and ``--header NAME=VALUE``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from processes import Processes, wait_live_workers

from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from lorabus.schemas import ErrorCode
from lorabus.simfleet import SimFleet

API_KEY = "s3cret"
KEY_VAR = "SIM_KEY"
WORLD_SIZES = {"alpha": 2, "beta": 1}
ENGINE_CALLS = [
    ("POST", "/engine/pause_generation"),
    ("POST", "/v1/loras"),
    ("POST", "/engine/resume_generation"),
]


@pytest.fixture
async def sim(start_sim: Callable[..., Awaitable[SimFleet]]) -> SimFleet:
    return await start_sim(WORLD_SIZES, api_key=API_KEY)


async def _start_fleet(
    processes: Processes,
    sim: SimFleet,
    nats_url: str,
    fleet: str,
    client: UpdateClient,
    *,
    agent_key: str | None,
) -> None:
    auth = ["--api-key-env", KEY_VAR, "--header", "X-Team=rl"]
    coordinator = CoordinatorConfig(
        fleet=fleet,
        frontend_url=sim.url,
        expected_world_size=sum(WORLD_SIZES.values()),
        phase_timeout_s=10,
        verify_timeout_s=10,
        quorum_timeout_s=10,
    )
    await processes.start_coordinator(
        coordinator, nats_url=nats_url, extra=auth, env={KEY_VAR: API_KEY}
    )
    await processes.start_agents(
        WORLD_SIZES,
        sim.system_url,
        frontend_url=sim.url,
        fleet=fleet,
        nats_url=nats_url,
        extra=auth,
        env_of=lambda _worker: {KEY_VAR: agent_key},
    )
    await wait_live_workers(client, WORLD_SIZES, processes=processes)


async def test_update_commits_with_key_and_extra_header_on_every_engine_call(
    processes: Processes,
    sim: SimFleet,
    client: UpdateClient,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    await _start_fleet(processes, sim, nats_url, fleet_name, client, agent_key=API_KEY)

    result = await client.update("policy", make_adapter(1), version=1, timeout_s=30)

    assert result.committed, result.error
    for worker_id, worker in sim.workers.items():
        calls = [(r.method, r.path) for r in worker.requests]
        for call in ENGINE_CALLS:
            assert call in calls, (worker_id, calls)
        for request in worker.requests:
            assert request.headers.get("authorization") == f"Bearer {API_KEY}", (
                worker_id,
                request.method,
                request.path,
            )
            assert request.headers.get("x-team") == "rl", (worker_id, request.method, request.path)


async def test_update_fails_naming_every_worker_whose_engine_answers_401(
    processes: Processes,
    sim: SimFleet,
    client: UpdateClient,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    await _start_fleet(processes, sim, nats_url, fleet_name, client, agent_key=None)

    result = await client.update("policy", make_adapter(1), version=1, timeout_s=30)

    assert result.status == "failed"
    assert result.error is not None
    assert result.error.code == ErrorCode.WORKER_FAILED, result.error
    for worker_id in WORLD_SIZES:
        assert worker_id in result.error.message, result.error.message
        outcome = result.workers[worker_id]
        assert not outcome.ok and outcome.error is not None, outcome
        assert "401" in outcome.error.message and "unauthorized" in outcome.error.message, (
            outcome.error
        )
    assert "401" in result.error.message and "unauthorized" in result.error.message
    for worker in sim.workers.values():
        assert not worker.paused and not worker.adapters, worker
