"""An agent serves every adapter the fleet has committed (issue 40), against a
real nats-server and simulated Dynamo workers over real HTTP, with adapters
that travel over the bus: ``policy`` v1, then ``other`` v7; w001's agent
restarts with an empty cache, on an engine that lost its adapters. It fetches
and loads both again, each from the fleet's object store, is not ready until
it has, and, while loading keeps failing, says what is missing. And the
agent's NATS identity may list the commit points it reads (a stream info,
not a consumer). The rest runs in memory (test_every_adapter_reloaded_in_memory.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from processes import wait_live_workers

from lorabus.agents import Agent, AgentConfig, driver_for
from lorabus.agents.beats import BeatPolicy
from lorabus.agents.bus import AgentBus
from lorabus.bus.connect import close, connect
from lorabus.client import UpdateClient
from lorabus.coordinator import Coordinator, CoordinatorConfig
from lorabus.schemas import MemberStatus, Subjects
from lorabus.security.roles import Role
from lorabus.simfleet import SimFleet
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 30.0
WORKERS = ["w000", "w001"]


@dataclass
class _Fleet:
    """A coordinator and an agent per simulated worker, each agent stopped and
    started again as a test says; everything stops with ``exits``."""

    nats_url: str
    fleet_name: str
    sim: SimFleet
    exits: contextlib.AsyncExitStack
    client: UpdateClient | None = None
    agents: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    async def serve(self, name: str, run: Callable[..., Awaitable[None]]) -> asyncio.Task[None]:
        """Run ``run(nc, ready)`` on a connection of its own until ready."""
        nc = await connect(self.nats_url, name=name)
        self.exits.push_async_callback(close, nc)
        ready = asyncio.Event()
        task = asyncio.create_task(run(nc, ready), name=name)
        self.exits.push_async_callback(_stop, task)
        waiting = asyncio.ensure_future(ready.wait())
        async with asyncio.timeout(DEADLINE_S):
            await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if task.done():
            task.result()  # raises what killed it
        return task

    async def start_agent(self, worker_id: str, cache_dir: Path) -> None:
        """Start ``worker_id``'s agent as ``lorabus agent`` does (the engine's
        list read first), with its cache in ``cache_dir``; return once ready."""
        config = AgentConfig(
            fleet=self.fleet_name,
            worker_id=worker_id,
            system_url=self.sim.system_url(worker_id),
            frontend_url=self.sim.url,
            heartbeat_s=0.2,
            cache_dir=str(cache_dir),
        )
        driver = driver_for(config)
        self.exits.push_async_callback(driver.aclose)
        agent = Agent.from_config(config, driver)
        await agent.executor.refresh()
        self.agents[worker_id] = await self.serve(f"test-agent-{worker_id}", agent.run)

    async def stop_agent(self, worker_id: str) -> None:
        await _stop(self.agents.pop(worker_id))

    async def member(self, worker_id: str, until: Callable[[MemberStatus], bool]) -> MemberStatus:
        """``worker_id`` as the coordinator's status shows it, once ``until`` holds."""
        assert self.client is not None
        async with asyncio.timeout(DEADLINE_S):
            while True:
                status = await self.client.status()
                member = next((m for m in status.members if m.worker_id == worker_id), None)
                if member is not None and until(member):
                    return member
                await asyncio.sleep(0.05)


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def fleet(nats_url: str, fleet_name: str, tmp_path: Path) -> AsyncIterator[_Fleet]:
    async with contextlib.AsyncExitStack() as exits:
        sim = await exits.enter_async_context(SimFleet(WORKERS, [1, 1]))
        started = _Fleet(nats_url, fleet_name, sim, exits)
        config = CoordinatorConfig(
            fleet=fleet_name,
            frontend_url=sim.url,
            expected_world_size=len(WORKERS),
            phase_timeout_s=10,
            verify_timeout_s=10,
        )
        # Stopped last: the agents go first (the exit stack unwinds backwards).
        await started.serve("test-coordinator", Coordinator(config).run)
        for worker_id in WORKERS:
            await started.start_agent(worker_id, tmp_path / "cache" / worker_id)
        started.client = await exits.enter_async_context(
            await UpdateClient.connect(nats_url, fleet_name)
        )
        await wait_live_workers(started.client, WORKERS)
        yield started


async def test_a_restarted_agent_with_an_empty_cache_loads_every_adapter_again(
    fleet: _Fleet, make_adapter: Callable[[int], str], tmp_path: Path
) -> None:
    assert fleet.client is not None
    for adapter, version in (("policy", 1), ("other", 7)):
        result = await fleet.client.update(adapter, source=make_adapter(version), version=version)
        assert result.committed, result.error
    await fleet.stop_agent("w001")
    engine = fleet.sim.workers["w001"]
    for name in list(engine.adapters):
        engine.remove_adapter(name)
    engine.set_faults(fail_next_loads=1000, load_failure_status=400)  # until told otherwise

    fresh_cache = tmp_path / "cache" / "w001-restarted"
    await fleet.start_agent("w001", fresh_cache)
    stuck = await fleet.member("w001", lambda m: bool(m.unready_reason))
    engine.set_faults(fail_next_loads=0)
    back = await fleet.member("w001", lambda m: m.ready)
    after = await fleet.client.update("policy", source=make_adapter(2), version=2)

    assert not stuck.ready and stuck.adapters == [], stuck
    # Committed versions are tried by adapter: other-v7 fails a third time first.
    reason = stuck.unready_reason
    assert reason.startswith("missing other-v7 (adapter other): loading it failed 3 times: "), (
        reason
    )
    assert "injected load failure" in reason and "; missing policy-v1 (adapter policy)" in reason
    assert sorted(back.adapters) == ["other-v7", "policy-v1"] and back.unready_reason == ""
    assert all(engine.adapter_paths[n].startswith(str(fresh_cache)) for n in back.adapters), (
        "fetched from the object store into the new cache"
    )
    assert after.committed and sorted(after.workers) == WORKERS, after


async def test_an_agent_may_list_the_commit_points_it_converges_on(
    secured_stack: EmbeddedStack, make_adapter: Callable[[int], str]
) -> None:
    """As its own identity, under its role's permissions: a stream info of the
    state bucket, filtered to ``committed.>``, and nothing more."""
    stack = secured_stack
    assert stack.client is not None
    for adapter, version in (("policy", 1), ("other", 7)):
        assert (
            await stack.client.update(adapter, make_adapter(version), version=version)
        ).committed
    nc = await stack.bus_as(Role.AGENT, "w001").connect("test-agent-identity")
    try:
        bus = AgentBus(
            nc,
            Subjects(fleet=stack.fleet_name),
            "w001",
            instance="test",
            beats=BeatPolicy(),
            max_adapter_bytes=1 << 20,
        )
        keys = await bus.state_keys("committed.>")
    finally:
        await close(nc)

    assert keys == ["committed.other", "committed.policy"]
