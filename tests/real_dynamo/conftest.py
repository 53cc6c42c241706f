"""Fixtures of the ``real_dynamo`` tier: a real Dynamo 1.6.1 fleet and lorabus around it.

The tier needs what ``scripts/install-real-dynamo`` builds; without its stamp
file every test here is skipped with the reason. One fleet (a frontend and
three LoRA workers) is shared by the whole session, because starting it costs
seconds on two cores; tests that share it use adapter names of their own.
Tests that break a fleet (kill a worker) build their own with
``make_dynamo_fleet``. lorabus runs as real processes (a coordinator and one
agent per worker), started and stopped per test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from processes import Processes, wait_live_workers
from real_fleet import DynamoFleet, Install, find_install

from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig

#: Worker ids and the world sizes their agents are given by flag (mixed on purpose).
WORLD_SIZES = {"w000": 2, "w001": 1, "w002": 4}
#: Timeouts handed to the coordinator: generous, only there so nothing hangs.
COORDINATOR_TIMEOUTS = {"phase_timeout_s": 20, "verify_timeout_s": 20, "quorum_timeout_s": 20}


@pytest.fixture(scope="session")
def dynamo_install() -> Install:
    install, reason = find_install()
    if install is None:
        pytest.skip(reason)
    return install


@pytest.fixture(scope="session")
def dynamo(
    dynamo_install: Install, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DynamoFleet]:
    """The shared fleet: a real frontend and workers w000, w001, w002."""
    fleet = DynamoFleet(dynamo_install, tmp_path_factory.mktemp("dynamo"), list(WORLD_SIZES))
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def make_dynamo_fleet(
    dynamo_install: Install, tmp_path: Path
) -> Iterator[Callable[..., DynamoFleet]]:
    """Start a fleet of this test's own, with extra environment per worker (and
    the frontend's router mode, and workers' disaggregation modes)."""
    started: list[DynamoFleet] = []

    def make(
        worker_env: Mapping[str, Mapping[str, str]],
        router_mode: str = "kv",
        modes: Mapping[str, str] | None = None,
    ) -> DynamoFleet:
        fleet = DynamoFleet(
            dynamo_install,
            tmp_path / "dynamo",
            list(WORLD_SIZES),
            worker_env,
            router_mode=router_mode,
            modes=modes or {},
        )
        started.append(fleet)
        fleet.start()
        return fleet

    try:
        yield make
    finally:
        for fleet in started:
            fleet.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as session:
        yield session


async def start_lorabus(
    processes: Processes,
    dynamo: DynamoFleet,
    client: UpdateClient,
    nats_url: str,
    **coordinator: Any,
) -> None:
    """A coordinator and one agent per worker (world size by flag); wait until all are live."""
    fleet = client.subjects.fleet
    config = CoordinatorConfig(
        fleet=fleet,
        frontend_url=dynamo.frontend_url,
        expected_world_size=sum(WORLD_SIZES.values()),
        **(COORDINATOR_TIMEOUTS | coordinator),
    )
    await processes.start_coordinator(config, nats_url=nats_url)
    await processes.start_agents(
        WORLD_SIZES,
        dynamo.system_url,
        fleet=fleet,
        nats_url=nats_url,
        frontend_url=dynamo.frontend_url,
        frontend_discovery_url=dynamo.rl_url,
    )
    await wait_live_workers(client, WORLD_SIZES, processes=processes, deadline_s=30)


async def worker_loras(http: httpx.AsyncClient, dynamo: DynamoFleet, worker_id: str) -> set[str]:
    """The adapters a real worker lists on its own ``GET /v1/loras``."""
    reply = await http.get(f"{dynamo.system_url(worker_id)}/v1/loras")
    assert reply.status_code == 200, reply.text
    return set(reply.json()["loras"])


async def frontend_models(http: httpx.AsyncClient, dynamo: DynamoFleet) -> set[str]:
    reply = await http.get(f"{dynamo.frontend_url}/v1/models")
    assert reply.status_code == 200, reply.text
    return {model["id"] for model in reply.json()["data"]}


async def worker_state(http: httpx.AsyncClient, dynamo: DynamoFleet, worker_id: str) -> dict:
    """The test worker's own view: pause flag, loads in progress, adapters."""
    reply = await http.post(f"{dynamo.system_url(worker_id)}/engine/lorabus_test_state", json={})
    assert reply.status_code == 200, reply.text
    state: dict = reply.json()
    return state
