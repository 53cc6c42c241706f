"""A real vLLM 0.32.0 server with two data-parallel engines (``--data-parallel-size
2``, one API server) on the CPU, under lorabus as users run it: the agent learns
the ranks from the server's config, announces them, and its canary asks each
rank; after the commit each rank answers with the adapter's weights.

The server is this module's own (a start costs about a minute), started once
for its tests and stopped after them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from convergence_helpers import member_until
from processes import Processes, wait_live_workers

from lorabus.agents import AgentConfig
from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from real_vllm.conftest import COORDINATOR_TIMEOUTS
from real_vllm.vllm_server import (
    BASE_MODEL,
    TEST_TIMEOUT_S,
    Install,
    VllmFleet,
    greedy_tokens,
)

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(TEST_TIMEOUT_S)]

WORKER = "w000"
RANKS = 2


@pytest.fixture(scope="module")
def dp_vllm(vllm_install: Install, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    fleet = VllmFleet(
        vllm_install,
        tmp_path_factory.mktemp("vllm-dp"),
        {WORKER: 8},
        extra_args=("--data-parallel-size", str(RANKS)),
    )
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


async def test_every_data_parallel_rank_serves_the_committed_adapter(
    dp_vllm: VllmFleet,
    processes: Processes,
    client: UpdateClient,
    http: httpx.AsyncClient,
    nats_url: str,
    adapters: Path,
) -> None:
    url = dp_vllm.url(WORKER)
    fleet = client.subjects.fleet
    coordinator = CoordinatorConfig(
        fleet=fleet, frontend_url=url, expected_world_size=RANKS, **COORDINATOR_TIMEOUTS
    )
    await processes.start_coordinator(coordinator, nats_url=nats_url)
    agent = AgentConfig(
        fleet=fleet, worker_id=WORKER, system_url=url, engine="vllm", world_size=RANKS
    )
    await processes.start_agent(agent, nats_url=nats_url)
    await wait_live_workers(client, {WORKER: RANKS}, processes=processes, deadline_s=60)
    member = await member_until(client, WORKER, lambda m: m.data_parallel == RANKS)
    assert member.ready
    base = [await greedy_tokens(http, url, BASE_MODEL, rank=r) for r in range(RANKS)]
    completions = dp_vllm.servers[WORKER].access_log("POST", "/v1/completions")

    result = await client.update("served", str(adapters / "a"), version=1, timeout_s=120)

    assert result.committed, result.error
    assert result.rank_map is not None
    [entry] = result.rank_map.entries
    assert (entry.world_size, entry.data_parallel) == (RANKS, RANKS)
    # The agent's canary asked each rank, and the coordinator the server once.
    assert dp_vllm.servers[WORKER].access_log("POST", "/v1/completions") >= completions + RANKS + 1
    served = [await greedy_tokens(http, url, "served-v1", rank=r) for r in range(RANKS)]
    assert served[0] == served[1], "two ranks answer differently with one adapter"
    assert served[0] != base[0], "the adapter's weights do not answer on the ranks"
