"""An engine's capacity: the most adapters it holds at once (coordinator/capacity.py).

Each agent says it in its heartbeat: what SGLang's server info shows
(``--max-loaded-loras``), or its own ``--max-adapters`` (vLLM, Dynamo). An
update whose members cannot hold what the fleet serves and the new version
beside it fails at once, ``no_capacity``, naming them, before anything is
paused or loaded; within capacity, a load at capacity first unloads the
oldest versions nothing keeps, never a committed or kept one.

A real coordinator and real agents on a real nats-server, over simulated
engines (real HTTP servers).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from convergence_helpers import member_until
from engine_fleet import StartFleet, engine_fleets
from memory_fleet import MemoryEngine
from processes import Processes

from lorabus.agents import AgentConfig, CommandExecutor
from lorabus.agents.desired import DesiredState, Target
from lorabus.audit.render import status_text
from lorabus.client import UpdateClient
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.schemas import ErrorCode, LoadCommand
from lorabus.simfleet import EngineSetup, SimFleet

StartSim = Callable[..., Awaitable[SimFleet]]


@pytest.fixture
async def start_fleet(nats_url: str, fleet_name: str, tmp_path: Path) -> AsyncIterator[StartFleet]:
    async with engine_fleets(nats_url, fleet_name, tmp_path) as start:
        yield start


async def test_an_update_that_cannot_fit_fails_at_once_naming_who_and_what_they_hold(
    start_fleet: StartFleet, make_adapter: Callable[[int], str]
) -> None:
    engines = {"w000": "sglang", "w001": "sglang"}
    client, sim = await start_fleet(engines, {"w000": EngineSetup(max_loaded_loras=2)}, keep=2)
    tight = await member_until(client, "w000", lambda m: m.capacity is not None)
    assert tight.capacity == 2  # read from the engine's server info
    for version in (1, 2):
        assert (await client.update("policy", make_adapter(version), version=version)).committed
    loads = {w: worker.loads_received for w, worker in sim.workers.items()}
    pauses = {
        w: worker.count_requests("POST", "/pause_generation") for w, worker in sim.workers.items()
    }

    # v3 beside v1 (kept) and v2 (committed): three at once, where w000 holds two.
    refused = await client.update("policy", make_adapter(3), version=3)

    assert refused.error is not None and refused.error.code == ErrorCode.NO_CAPACITY, refused
    message = refused.error.message
    assert "w000 (capacity 2; holds 2)" in message, message
    assert "policy-v1" not in message  # counted, not named: the names may be another's
    assert "w001" not in message
    assert {w: worker.loads_received for w, worker in sim.workers.items()} == loads
    assert {
        w: worker.count_requests("POST", "/pause_generation") for w, worker in sim.workers.items()
    } == pauses
    status = await client.status()
    assert [(a.adapter, a.version) for a in status.adapters] == [("policy", 2)]
    assert "2/2: policy-v1, policy-v2" in status_text(status)
    assert sorted(sim.workers["w000"].adapters) == ["policy-v1", "policy-v2"]


async def test_a_load_at_capacity_unloads_the_oldest_version_nothing_keeps_first(
    start_fleet: StartFleet, make_adapter: Callable[[int], str]
) -> None:
    engines = {"w000": "vllm", "w001": "vllm"}
    client, sim = await start_fleet(engines, {}, max_adapters={"w000": 3}, keep=1)
    assert (await member_until(client, "w000", lambda m: m.capacity == 3)).capacity == 3
    first = make_adapter(1)
    assert (await client.update("a", first, version=1)).committed
    assert (await client.update("b", make_adapter(2), version=1)).committed
    assert (await client.update("a", make_adapter(3), version=2)).committed
    # A leftover of a retire that did not happen: a-v1, which nothing keeps.
    tight = sim.workers["w000"]
    tight.add_adapter("a-v1", first)
    assert sorted(tight.adapters) == ["a-v1", "a-v2", "b-v1"]  # full

    result = await client.update("c", make_adapter(4), version=1)

    assert result.committed, result.error
    assert sorted(tight.adapters) == ["a-v2", "b-v1", "c-v1"]
    assert sorted(sim.workers["w001"].adapters) == ["a-v2", "b-v1", "c-v1"]


async def test_the_executor_makes_room_before_a_load_or_refuses_it() -> None:
    """The real executor on an engine in memory, at capacity: it unloads what
    is spare before the load; with nothing spare it loads nothing."""
    engine = MemoryEngine(adapters=["a-v2", "b-v1", "a-v1"])
    executor = CommandExecutor("w0", 1, engine, max_adapters=3)
    executor.spare = lambda held: [n for n in held if n == "a-v1"]
    await executor.refresh()
    load = LoadCommand(update_id="u1", targets=["w0"], budget_s=10, served_name="c-v1", path="/c")

    ack = await executor.execute(load, 10)

    assert ack.ok, ack.error
    assert engine.calls == ["unload", "load"] and engine.adapters == ["a-v2", "b-v1", "c-v1"]
    executor.spare = lambda held: []
    refused = await executor.execute(
        LoadCommand(update_id="u2", targets=["w0"], budget_s=10, served_name="d-v1", path="/d"),
        10,
    )
    assert refused.error is not None and refused.error.code == ErrorCode.NO_CAPACITY
    assert "holds 3 adapters, its capacity" in refused.error.message
    assert engine.calls == ["unload", "load"]  # nothing more was asked of the engine


def test_only_old_versions_nothing_keeps_are_spare() -> None:
    desired = DesiredState()
    desired.learn(Target(adapter="a", served_name="a-v5", path="/a/5", version=5))
    desired.learn(Target(adapter="a-v", served_name="a-v-v2", path="/av/2", version=2))
    desired.learn(Target(adapter="r", served_name="r-r2-v3", path="/r/3", version=3, lineage=2))
    held = ["a-v5", "a-v4", "a-v6", "a-v1", "a-v-v1", "x-v1", "r-r2-v1", "r-v1", "a"]
    # Older than committed and not kept, oldest first; not a newer one (an
    # update may be loading it), not one of an adapter no commit names, not
    # one of another lineage.
    assert desired.stale(held) == ["a-v-v1", "a-v1", "r-r2-v1", "a-v4"]


async def test_a_lorabus_agent_process_announces_its_sglangs_capacity(
    processes: Processes, client: UpdateClient, nats_url: str, start_sim: StartSim
) -> None:
    """As users run it (``lorabus agent``, its driver wrapped for metrics):
    the capacity SGLang's server info shows reaches the heartbeat."""
    sim = await start_sim({"w000": 1}, engines=["sglang"])
    sim.workers["w000"].set_setup(max_loaded_loras=3)
    coordinator = CoordinatorConfig(
        fleet=client.subjects.fleet, frontend_url=sim.url, expected_world_size=1
    )
    await processes.start_coordinator(coordinator, nats_url=nats_url)
    config = AgentConfig(
        fleet=client.subjects.fleet,
        worker_id="w000",
        system_url=sim.system_url("w000"),
        engine="sglang",
        heartbeat_s=0.2,
    )
    await processes.start_agent(config, nats_url=nats_url)

    member = await member_until(client, "w000", lambda m: m.capacity is not None)

    assert member.capacity == 3
