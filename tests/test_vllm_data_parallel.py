"""A vLLM server with several data-parallel ranks: the agent learns them from
the server's config, its canary asks every rank, and a server whose API servers
each keep their own registry of names is refused at start, saying how to fix it.

The simulated vLLM models what vLLM 0.32 does (docs/engines.md, "Data-parallel
ranks"): a load reaches every rank it fronts but registers the name in the one
API server that answered; each rank answers a completion on its own
(``X-data-parallel-rank``); a rank may miss a load. A real coordinator and real
``lorabus agent`` processes (the driver as users run it, metrics wrapper and
all) on a real nats-server show the end to end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from adapter_dirs import write_adapter
from convergence_helpers import member_until
from processes import Processes, wait_live_workers

from lorabus.agents import AgentConfig, driver_for
from lorabus.agents.vllm import VllmDriver, fronted_ranks
from lorabus.client import UpdateClient
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.errors import CanaryFailed
from lorabus.schemas import ErrorCode
from lorabus.simfleet import SimFleet

DEADLINE_S = 30.0
WORLD_SIZES = {"w000": 4, "w001": 1}
"""w000: a server of 2 data-parallel ranks of 2 GPUs each; w001: one rank."""


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    async with SimFleet(list(WORLD_SIZES), [2, 1], engines=["vllm"]) as fleet:
        fleet.workers["w000"].set_setup(data_parallel_size=2)
        yield fleet


@pytest.fixture
async def driver(sim: SimFleet) -> AsyncIterator[VllmDriver]:
    config = AgentConfig(
        fleet="f", worker_id="w000", system_url=sim.system_url("w000"), engine="vllm"
    )
    made = driver_for(config)
    assert isinstance(made, VllmDriver)
    yield made
    await made.aclose()


async def test_the_set_up_check_learns_the_ranks_and_the_canary_asks_each(
    sim: SimFleet, driver: VllmDriver, tmp_path: Any
) -> None:
    assert await driver.setup_problem() is None
    assert driver.data_parallel == 2
    sim.workers["w000"].add_adapter("policy-v1", str(tmp_path))

    await driver.canary("policy-v1", budget_s=5)

    ranks = [r.headers.get("x-data-parallel-rank") for r in _completions(sim, "w000")]
    assert ranks == ["0", "1"]


async def test_a_rank_that_missed_the_load_fails_the_canary_naming_it(
    sim: SimFleet, driver: VllmDriver, tmp_path: Any
) -> None:
    assert await driver.setup_problem() is None
    worker = sim.workers["w000"]
    worker.set_faults(load_misses_ranks=[1])
    adapter = write_adapter(tmp_path / "a")
    await driver.load_adapter("policy-v1", str(adapter), budget_s=5)
    assert await driver.list_adapters() == ["policy-v1"]  # the list is one rank's

    with pytest.raises(CanaryFailed, match="data-parallel rank 1"):
        await driver.canary("policy-v1", budget_s=5)


async def test_several_api_servers_are_refused_at_start_saying_how_to_fix_it(
    sim: SimFleet, driver: VllmDriver
) -> None:
    sim.workers["w000"].set_setup(api_server_count=2)

    problem = await driver.setup_problem()

    assert problem is not None
    assert "2 API servers" in problem and "--api-server-count 1" in problem


async def test_an_update_proves_every_rank_and_status_shows_them(
    sim: SimFleet,
    processes: Processes,
    client: UpdateClient,
    nats_url: str,
    make_adapter: Callable[[int], str],
) -> None:
    await _fleet(sim, processes, client, nats_url)
    member = await member_until(client, "w000", lambda m: m.data_parallel == 2)
    assert member.world_size == 4

    result = await client.update("policy", make_adapter(1), version=1, timeout_s=DEADLINE_S)

    assert result.committed, result.error
    assert result.rank_map is not None
    entries = {e.worker_id: (e.world_size, e.data_parallel) for e in result.rank_map.entries}
    assert entries == {"w000": (4, 2), "w001": (1, 1)}
    ranks = sorted(r.headers.get("x-data-parallel-rank") or "" for r in _completions(sim, "w000"))
    assert ranks[-2:] == ["0", "1"]  # the agent's canary, on each rank

    # A rank that misses the next load fails that update, naming the worker and rank.
    sim.workers["w000"].set_faults(load_misses_ranks=[1])
    missed = await client.update("policy", make_adapter(2), version=2, timeout_s=DEADLINE_S)

    assert not missed.committed
    failed = missed.workers["w000"].error
    assert failed is not None and failed.code == ErrorCode.CANARY_FAILED
    assert "w000" in failed.message and "data-parallel rank 1" in failed.message
    assert not any(w.paused for w in sim.workers.values())


async def test_a_server_with_several_api_servers_is_not_ready_and_status_says_why(
    sim: SimFleet, processes: Processes, client: UpdateClient, nats_url: str
) -> None:
    sim.workers["w000"].set_setup(api_server_count=2)
    await _fleet(sim, processes, client, nats_url, live=False)

    member = await member_until(client, "w000", lambda m: bool(m.unready_reason))

    assert not member.ready
    assert "--api-server-count 1" in member.unready_reason


def _completions(sim: SimFleet, worker_id: str) -> list[Any]:
    return [
        r
        for r in sim.workers[worker_id].requests
        if (r.method, r.path) == ("POST", "/v1/completions")
    ]


async def _fleet(
    sim: SimFleet, processes: Processes, client: UpdateClient, nats_url: str, *, live: bool = True
) -> None:
    fleet = client.subjects.fleet
    coordinator = CoordinatorConfig(
        fleet=fleet,
        frontend_url=sim.url,
        expected_world_size=sum(WORLD_SIZES.values()),
        phase_timeout_s=20,
        verify_timeout_s=20,
    )
    await processes.start_coordinator(coordinator, nats_url=nats_url)
    for worker_id, world_size in WORLD_SIZES.items():
        config = AgentConfig(
            fleet=fleet,
            worker_id=worker_id,
            system_url=sim.system_url(worker_id),
            engine="vllm",
            world_size=world_size,
            heartbeat_s=0.2,
        )
        await processes.start_agent(config, nats_url=nats_url)
    if live:
        await wait_live_workers(client, WORLD_SIZES, processes=processes)


@pytest.mark.parametrize(
    ("parallel", "ranks"),
    [
        ({"data_parallel_size": 1}, [(0, 0)]),
        (
            {"data_parallel_size": 4, "data_parallel_size_local": 2},
            [(0, 0), (1, 1), (2, 2), (3, 3)],
        ),
        (
            {
                "data_parallel_size": 4,
                "data_parallel_size_local": 2,
                "data_parallel_rank": 2,
                "data_parallel_hybrid_lb": True,
            },
            [(0, 2), (1, 3)],  # the header counts the node's engines from 0
        ),
        (
            {"data_parallel_size": 4, "data_parallel_rank": 3, "data_parallel_external_lb": True},
            [(0, 3)],
        ),
        ({"data_parallel_size": "4", "data_parallel_rank": -1}, [(0, 0)]),  # odd values: one rank
    ],
)
def test_the_ranks_a_server_fronts_follow_its_balancing(
    parallel: dict[str, Any], ranks: list[tuple[int, int]]
) -> None:
    assert fronted_ranks(parallel) == ranks


async def test_a_config_claiming_more_ranks_than_any_fleet_is_refused(
    sim: SimFleet, driver: VllmDriver
) -> None:
    sim.workers["w000"].set_setup(data_parallel_size=5000)

    problem = await driver.setup_problem()

    assert problem is not None and "more than 1024" in problem
    assert driver.data_parallel == 1
