"""Every driver's canary asks its own engine for one token with the served name,
over that engine's route, and fails when the engine lists the name but does not
serve it; after a fixed-name replace the engine's prefix cache is reset first.

The drivers are built as an agent builds them (``driver_for``) and run against
the simulated fleet's personality of each engine over real HTTP. A Dynamo
worker generates only through its frontend, routed to it by instance id.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from adapter_dirs import write_adapter

from lorabus.agents import AgentConfig, CommandExecutor, EngineDriver, driver_for
from lorabus.errors import CanaryFailed
from lorabus.schemas import CanaryCommand, ErrorCode, LoadCommand
from lorabus.simfleet import ENGINES, SimFleet

KINDS = pytest.mark.parametrize("kind", ENGINES)
#: Each engine's canary request, as the worker's request log records it.
CANARY_ROUTE = {"dynamo": "/v1/completions", "vllm": "/v1/completions", "sglang": "/generate"}


@pytest.fixture
async def sim(kind: str) -> AsyncIterator[SimFleet]:
    async with SimFleet(["w1", "w2"], [1, 1], api_key="k", engines=[kind]) as fleet:
        yield fleet


@pytest.fixture
async def driver(sim: SimFleet, kind: str) -> AsyncIterator[EngineDriver]:
    config = AgentConfig(
        fleet="f",
        worker_id="w1",
        system_url=sim.system_url("w1"),
        frontend_url=sim.url if kind == "dynamo" else "",
        engine=kind,
        engine_timeout_s=5,
        headers={"Authorization": "Bearer k"},
    )
    engine = driver_for(config)
    yield engine
    await engine.aclose()


def _canaries(sim: SimFleet, worker_id: str, kind: str) -> int:
    return sim.workers[worker_id].count_requests("POST", CANARY_ROUTE[kind])


@KINDS
async def test_a_served_name_answers_on_this_engine(
    kind: str, sim: SimFleet, driver: EngineDriver, tmp_path: Path
) -> None:
    for worker in sim.workers.values():
        worker.add_adapter("policy-v1", str(tmp_path))

    text = await driver.canary("policy-v1", budget_s=5)

    assert "w1" in text and "policy-v1" in text  # the simulator names who answered
    assert _canaries(sim, "w1", kind) == 1
    assert _canaries(sim, "w2", kind) == 0  # a Dynamo canary is routed to its worker alone


@KINDS
async def test_a_name_the_engine_lists_but_does_not_serve_fails_at_once(
    kind: str, sim: SimFleet, driver: EngineDriver, tmp_path: Path
) -> None:
    for worker in sim.workers.values():
        worker.add_adapter("policy-v1", str(tmp_path))
    sim.workers["w1"].set_faults(unroutable=["policy-v1"])  # w2 serves it: no help to w1

    with pytest.raises(CanaryFailed) as failed:
        await driver.canary("policy-v1", budget_s=5)

    assert not failed.value.retryable
    assert failed.value.status in (400, 404)
    assert _canaries(sim, "w1", kind) == 1  # final: not asked again
    assert await driver.list_adapters() == ["policy-v1"]  # what only a generation finds


@pytest.mark.parametrize("kind", ["dynamo"])
async def test_a_dynamo_agent_without_a_frontend_says_how_to_give_one(sim: SimFleet) -> None:
    config = AgentConfig(fleet="f", worker_id="w1", system_url=sim.system_url("w1"))
    engine = driver_for(config)
    try:
        with pytest.raises(CanaryFailed, match="--frontend-url"):
            await engine.canary("policy-v1", budget_s=5)
    finally:
        await engine.aclose()


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_a_fixed_name_replaced_resets_the_prefix_cache_before_the_canary(
    kind: str, sim: SimFleet, driver: EngineDriver, tmp_path: Path
) -> None:
    old = write_adapter(tmp_path / "old", b"old weights")
    new = write_adapter(tmp_path / "new", b"new weights")
    executor = CommandExecutor("w1", 1, driver)
    first = LoadCommand(
        update_id="u1", targets=["w1"], budget_s=5, served_name="policy", path=str(old)
    )
    assert (await executor.execute(first, 5)).ok
    worker = sim.workers["w1"]
    worker.requests.clear()

    replaced = await executor.execute(
        LoadCommand(
            update_id="u2",
            targets=["w1"],
            budget_s=5,
            served_name="policy",
            path=str(new),
            replace=True,
        ),
        5,
    )
    canary = await executor.execute(
        CanaryCommand(update_id="u2", targets=["w1"], budget_s=5, served_name="policy"), 5
    )

    assert replaced.ok and canary.ok, (replaced.error, canary.error)
    posts = [r.path for r in worker.requests if r.method == "POST"]
    reset = "/reset_prefix_cache" if kind == "vllm" else "/flush_cache"
    assert posts.index(reset) > max(
        i for i, p in enumerate(posts) if p.endswith("load_lora_adapter")
    )
    assert posts[-1] == CANARY_ROUTE[kind]


@pytest.mark.parametrize("kind", ["vllm"])
async def test_a_failed_canary_acks_the_worker_and_the_engines_answer(
    sim: SimFleet, driver: EngineDriver
) -> None:
    executor = CommandExecutor("w1", 1, driver)
    ack = await executor.execute(
        CanaryCommand(update_id="u1", targets=["w1"], budget_s=5, served_name="policy-v9"), 5
    )

    assert not ack.ok and ack.error is not None
    assert ack.error.code == ErrorCode.CANARY_FAILED
    assert "w1" in ack.error.message and "does not exist" in ack.error.message


@pytest.mark.parametrize("kind", ["dynamo"])
async def test_a_restarted_worker_is_found_again_under_its_new_instance_id(
    sim: SimFleet, driver: EngineDriver, tmp_path: Path
) -> None:
    for worker in sim.workers.values():
        worker.add_adapter("policy-v1", str(tmp_path))
    await driver.canary("policy-v1", budget_s=5)
    sim.workers["w1"].instance_id += 1  # it registered again, as a restart does

    await driver.canary("policy-v1", budget_s=5)

    assert _canaries(sim, "w1", "dynamo") == 2
    assert _canaries(sim, "w2", "dynamo") == 0


@pytest.mark.parametrize("kind", ["dynamo"])
async def test_a_worker_reached_by_another_host_name_is_found_by_port_and_path(
    sim: SimFleet, tmp_path: Path
) -> None:
    """The agent reaches its worker as ``localhost`` where the worker
    advertises ``127.0.0.1`` (a container's name, say): one entry has its
    port and path, so that one is it."""
    for worker in sim.workers.values():
        worker.add_adapter("policy-v1", str(tmp_path))
    config = AgentConfig(
        fleet="f",
        worker_id="w1",
        system_url=sim.system_url("w1").replace("127.0.0.1", "localhost"),
        frontend_url=sim.url,
        headers={"Authorization": "Bearer k"},
    )
    engine = driver_for(config)
    try:
        await engine.canary("policy-v1", budget_s=5)
    finally:
        await engine.aclose()

    assert _canaries(sim, "w1", "dynamo") == 1
