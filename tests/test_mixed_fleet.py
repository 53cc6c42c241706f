"""A fleet of Dynamo, vLLM and SGLang workers updates as one, and says which engine each runs.

Real NATS, a real ``lorabus coordinator`` and one real ``lorabus agent
--engine <kind>`` process per worker, against a simulated fleet whose workers
play the three engines over real HTTP (``SimFleet(engines=...)``). What each
engine received and holds is read where the engine keeps it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from processes import Processes, run_lorabus, wait_live_workers

from lorabus.agents import AgentConfig
from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from lorabus.schemas import ErrorCode
from lorabus.simfleet import SimFleet

WORLD_SIZES = {"w000": 2, "w001": 1, "w002": 4}
ENGINES = {"w000": "dynamo", "w001": "vllm", "w002": "sglang"}


@pytest.fixture
async def mixed(
    nats_url: str,
    fleet_name: str,
    processes: Processes,
    client: UpdateClient,
    start_sim: Callable[..., Awaitable[SimFleet]],
) -> AsyncIterator[SimFleet]:
    """The simulated fleet, its coordinator and one agent per worker, all live."""
    sim = await start_sim(WORLD_SIZES, engines=list(ENGINES.values()))
    coordinator = CoordinatorConfig(
        fleet=fleet_name,
        frontend_url=sim.url,
        expected_world_size=sum(WORLD_SIZES.values()),
        phase_timeout_s=20,
        verify_timeout_s=20,
    )
    await processes.start_coordinator(coordinator, nats_url=nats_url)
    for worker_id, worker in sim.workers.items():
        config = AgentConfig(
            fleet=fleet_name,
            worker_id=worker_id,
            system_url=sim.system_url(worker_id),
            frontend_url=sim.url if worker.engine == "dynamo" else "",
            world_size=worker.world_size,
            engine=worker.engine,
            heartbeat_s=0.2,
        )
        await processes.start_agent(config, nats_url=nats_url)
    await wait_live_workers(client, set(WORLD_SIZES), processes=processes)
    yield sim


def _loads(sim: SimFleet) -> dict[str, int]:
    return {worker_id: worker.loads_received for worker_id, worker in sim.workers.items()}


async def test_a_mixed_fleet_commits_every_engine_serves_it_and_status_names_each_engine(
    mixed: SimFleet,
    client: UpdateClient,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    path = make_adapter(1)
    before = _loads(mixed)

    result = await client.update("policy", path, version=1)

    assert result.committed, result.error
    assert result.adapter == "policy-v1"
    assert result.rank_map is not None
    for worker_id, worker in mixed.workers.items():
        assert worker.engine == ENGINES[worker_id]
        assert worker.loads_received - before[worker_id] == 1, (worker_id, worker.requests)
        assert "policy-v1" in worker.adapters and not worker.paused, worker_id
        assert result.workers[worker_id].ok, result.workers[worker_id]
    # vLLM and SGLang read the path back as the adapter's root in /v1/models.
    async with httpx.AsyncClient(timeout=10) as http:
        for worker_id in ("w001", "w002"):
            models = (await http.get(f"{mixed.system_url(worker_id)}/v1/models")).json()
            roots = {m["id"]: m["root"] for m in models["data"] if m["parent"]}
            assert roots == {"policy-v1": path}, (worker_id, models)
        # The frontend routes the served name to every engine that holds it.
        served_by = set()
        for _ in range(len(WORLD_SIZES)):
            chat = {"model": "policy-v1", "messages": [{"role": "user", "content": "hi"}]}
            reply = await http.post(f"{mixed.url}/v1/chat/completions", json=chat)
            assert reply.status_code == 200, reply.text
            served_by.add(reply.json()["served_by"])
    assert served_by == set(WORLD_SIZES)

    done = await run_lorabus("status", "--nats", nats_url, "--fleet", fleet_name, "--json")

    assert done.returncode == 0, done
    status = json.loads(done.stdout.strip().splitlines()[-1])
    assert {m["worker_id"]: m["engine"] for m in status["members"]} == ENGINES
    assert status["committed_adapter"] == "policy-v1"


async def test_a_directory_without_an_adapter_fails_fast_on_every_engine(
    mixed: SimFleet, client: UpdateClient, tmp_path: Path
) -> None:
    # Each engine says so its own way (Dynamo's 500, vLLM's 404, SGLang's
    # 400); each is asked once, and every engine is resumed.
    directory = tmp_path / "step_7"
    directory.mkdir()
    (directory / "README.md").write_text("no adapter here\n")
    before = _loads(mixed)

    result = await client.update("policy", str(directory), version=1)

    assert result.status == "failed"
    assert result.error is not None and result.error.code == ErrorCode.WORKER_FAILED
    for worker_id, worker in mixed.workers.items():
        assert worker.loads_received - before[worker_id] == 1, (worker_id, worker.requests)
        outcome = result.workers[worker_id]
        assert not outcome.ok and outcome.error is not None, outcome
        assert outcome.error.code == ErrorCode.ENGINE_ERROR, outcome.error
        assert "not retried" in outcome.error.message, outcome.error
        assert not worker.paused and "policy-v1" not in worker.adapters, worker_id
    assert "resume" in result.phases
