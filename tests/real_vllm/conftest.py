"""Fixtures of the ``real_vllm`` tier: real vLLM 0.32.0 servers on the CPU and lorabus around them.

The tier needs what ``scripts/install-real-vllm`` builds; without its stamp
file every test here is skipped with the reason. Two servers (workers w000
and w001, the smallest real fleet) are shared by the tier's tests and
stopped after the last of them, not held for the rest of the run: a start
costs about 50 s, nearly all of it imports on one core, and about 3 GB, so
two start side by side in the time of one on two cores, and are started
once. Tests that share them use adapter names of their own. The servers
differ in one setting only: w000 takes adapters up to rank 16, w001 up to
rank 8, so that one adapter loads on one and fails on the other. lorabus
runs as real processes (a coordinator and one ``lorabus agent --engine
vllm`` per server), started and stopped per test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from processes import Processes, wait_live_workers

from lorabus.agents import AgentConfig
from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from real_vllm.vllm_server import MAX_LORA_RANKS, Install, VllmFleet, find_install

#: Timeouts handed to the coordinator: generous, only there so nothing hangs.
COORDINATOR_TIMEOUTS = {"phase_timeout_s": 60, "verify_timeout_s": 30, "quorum_timeout_s": 30}


@pytest.fixture(scope="session")
def vllm_install() -> Install:
    install, reason = find_install()
    if install is None:
        pytest.skip(reason)
    return install


@pytest.fixture(scope="package")
def vllm(vllm_install: Install, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    """The shared servers, one per worker of ``MAX_LORA_RANKS``."""
    fleet = VllmFleet(vllm_install, tmp_path_factory.mktemp("vllm"), MAX_LORA_RANKS)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0) as session:
        yield session


@pytest.fixture
def adapters(vllm_install: Install) -> Path:
    """The install's adapters ``a`` and ``b`` of the tiny model (read only)."""
    return vllm_install.adapters


@pytest.fixture
def start_lorabus(
    processes: Processes, vllm: VllmFleet, client: UpdateClient, nats_url: str
) -> Callable[..., Awaitable[None]]:
    """Start a coordinator (``--frontend-url`` at w000's server, which lists
    every adapter it serves in ``/v1/models``) and one ``lorabus agent
    --engine vllm`` per server; wait until all are live. Keyword arguments
    are coordinator settings."""

    async def start(**coordinator: Any) -> None:
        fleet = client.subjects.fleet
        config = CoordinatorConfig(
            fleet=fleet,
            frontend_url=vllm.url("w000"),
            expected_world_size=len(MAX_LORA_RANKS),
            **(COORDINATOR_TIMEOUTS | coordinator),
        )
        await processes.start_coordinator(config, nats_url=nats_url)
        for worker_id in MAX_LORA_RANKS:
            agent = AgentConfig(
                fleet=fleet,
                worker_id=worker_id,
                system_url=vllm.url(worker_id),
                engine="vllm",
                # The default interval: each vLLM server's worker spins on a
                # core of its own, so on a two-core machine an agent can wait
                # longer than three short beats for the CPU.
            )
            await processes.start_agent(agent, nats_url=nats_url)
        await wait_live_workers(client, MAX_LORA_RANKS, processes=processes, deadline_s=30)

    return start
