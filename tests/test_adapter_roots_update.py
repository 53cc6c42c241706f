"""Updates under adapter roots: a root reached through a symlink still commits, and
a symlink out of the root is refused where it is seen, by the coordinator when its
host sees the path, by every agent otherwise, with no engine loading it.

A real coordinator and real agents (each with ``adapter_roots``) on a real
nats-server, over a simulated Dynamo fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from processes import wait_live_workers

from lorabus.agents import Agent, AgentConfig, driver_for
from lorabus.bus.connect import close, connect
from lorabus.client import UpdateClient
from lorabus.coordinator import Coordinator, CoordinatorConfig
from lorabus.schemas import ErrorCode
from lorabus.simfleet import SimFleet
from lorabus.testbed.stack import EmbeddedStack
from lorabus.testbed.trainer import write_adapter

WORLD_SIZES = {"w000": 2, "w001": 1}

StartFleet = Callable[..., Awaitable[tuple[UpdateClient, SimFleet]]]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The adapter root as configured: a symlink to where adapters really are."""
    (tmp_path / "adapters").mkdir()
    (tmp_path / "current").symlink_to(tmp_path / "adapters")
    return tmp_path / "current"


async def _serve(
    tasks: list[asyncio.Task[None]], nats_url: str, name: str, run: Any
) -> Callable[[], Awaitable[None]]:
    """Run ``run(nc, ready)`` in a task of ``tasks`` until ready; returns the closer of nc."""
    nc = await connect(nats_url, name=name)
    ready = asyncio.Event()
    task = asyncio.create_task(run(nc, ready), name=name)
    tasks.append(task)
    waiter = asyncio.ensure_future(ready.wait())
    await asyncio.wait({task, waiter}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task.done():
        task.result()  # raises what killed it
    assert ready.is_set(), f"{name} did not start within 10s"
    return lambda: close(nc)


@pytest.fixture
async def start_fleet(
    nats_url: str,
    fleet_name: str,
    start_sim: Callable[..., Awaitable[SimFleet]],
) -> AsyncIterator[StartFleet]:
    """Start a coordinator with ``coordinator_roots`` and one agent per worker with
    ``agent_roots``; everything stops when the test ends, the coordinator first."""
    async with contextlib.AsyncExitStack() as stack:
        coordinator_tasks: list[asyncio.Task[None]] = []
        agent_tasks: list[asyncio.Task[None]] = []

        async def stop() -> None:
            for group in (coordinator_tasks, agent_tasks):
                for task in group:
                    task.cancel()
                await asyncio.gather(*group, return_exceptions=True)

        async def start(
            coordinator_roots: Sequence[Path], agent_roots: Sequence[Path]
        ) -> tuple[UpdateClient, SimFleet]:
            sim = await start_sim(WORLD_SIZES)
            config = CoordinatorConfig(
                fleet=fleet_name,
                frontend_url=sim.url,
                expected_world_size=sum(WORLD_SIZES.values()),
                phase_timeout_s=10,
                adapter_roots=[str(r) for r in coordinator_roots],
            )
            stack.push_async_callback(stop)
            closer = await _serve(
                coordinator_tasks, nats_url, "test-coordinator", Coordinator(config).run
            )
            stack.push_async_callback(closer)
            for worker_id, world_size in WORLD_SIZES.items():
                agent_config = AgentConfig(
                    fleet=fleet_name,
                    worker_id=worker_id,
                    system_url=sim.system_url(worker_id),
                    frontend_url=sim.url,
                    world_size=world_size,
                    heartbeat_s=0.2,
                    adapter_roots=[str(r) for r in agent_roots],
                )
                driver = driver_for(agent_config)
                stack.push_async_callback(driver.aclose)
                agent = Agent.from_config(agent_config, driver)
                closer = await _serve(agent_tasks, nats_url, f"test-agent-{worker_id}", agent.run)
                stack.push_async_callback(closer)
            client = await stack.enter_async_context(
                await UpdateClient.connect(nats_url, fleet_name)
            )
            await wait_live_workers(client, WORLD_SIZES)
            return client, sim

        yield start


def _loads(sim: SimFleet) -> list[Any]:
    return [
        r.body
        for w in sim.workers.values()
        for r in w.requests
        if r.method == "POST" and r.path == "/v1/loras"
    ]


async def test_an_update_through_a_root_that_is_a_symlink_commits(
    start_fleet: StartFleet, root: Path, tmp_path: Path
) -> None:
    client, sim = await start_fleet(coordinator_roots=[root], agent_roots=[root])
    adapter = write_adapter(root, 1)

    result = await client.update("policy", str(adapter), version=1)

    assert result.committed, result.error
    real = tmp_path / "adapters" / "step_1"
    assert _loads(sim) == [{"lora_name": "policy-v1", "source": {"uri": real.as_uri()}}] * 2


async def test_agents_refuse_a_symlink_out_of_their_root_that_the_coordinator_lets_by(
    start_fleet: StartFleet, root: Path, tmp_path: Path
) -> None:
    client, sim = await start_fleet(coordinator_roots=[], agent_roots=[root])
    (root / "step_1").symlink_to(write_adapter(tmp_path / "elsewhere", 1))

    result = await client.update("policy", str(root / "step_1"), version=1)

    assert result.status == "failed"
    assert result.error is not None and result.error.code == ErrorCode.WORKER_FAILED
    for worker_id, outcome in result.workers.items():
        assert outcome.error is not None and outcome.error.code == ErrorCode.PATH_REFUSED
        assert f"{worker_id} refused the load" in outcome.error.message
    assert _loads(sim) == []
    assert not any(worker.paused for worker in sim.workers.values())
    assert not any(worker.adapters for worker in sim.workers.values())


async def test_the_coordinator_refuses_a_symlink_out_of_the_root_it_can_see(
    start_fleet: StartFleet, root: Path, tmp_path: Path
) -> None:
    client, sim = await start_fleet(coordinator_roots=[root], agent_roots=[root])
    (root / "step_1").symlink_to(write_adapter(tmp_path / "elsewhere", 1))

    result = await client.update("policy", str(root / "step_1"), version=1)

    assert result.status == "failed"
    assert result.error is not None and result.error.code == ErrorCode.BAD_REQUEST
    assert "outside the adapter roots" in result.error.message
    # The agents' own quiet-time checks GET /v1/loras; only a POST would be this update's.
    posted = [r.path for w in sim.workers.values() for r in w.requests if r.method == "POST"]
    assert not any(path.endswith(("/pause_generation", "/v1/loras")) for path in posted), posted


async def test_the_embedded_stack_checks_adapter_roots_on_agents_and_coordinator(
    nats_url: str, fleet_name: str, tmp_path: Path
) -> None:
    # lorabus up runs this way: its trainer's directory is the only root.
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.mkdir()
    outside.mkdir()
    (inside / "escape").symlink_to(write_adapter(outside, 1))
    async with EmbeddedStack(
        [1, 1], fleet=fleet_name, nats_url=nats_url, heartbeat_s=0.2, adapter_roots=[str(inside)]
    ) as stack:
        assert stack.client is not None
        escaped = await stack.client.update("policy", str(inside / "escape"), version=1)
        committed = await stack.client.update("policy", str(write_adapter(inside, 2)), version=2)

    assert not escaped.committed and escaped.error is not None
    assert escaped.error.code is ErrorCode.BAD_REQUEST
    assert "outside the adapter roots" in escaped.error.message
    assert committed.committed, committed.error
