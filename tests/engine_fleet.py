"""A fleet of simulated vLLM or SGLang workers, each started as a test says, with a
real coordinator and real agents in this process, on a real nats-server.

``EmbeddedStack`` plays Dynamo workers only; the engine tests need other
kinds and engines started without a flag (``EngineSetup``), so they start
their fleet here: the agents as ``lorabus agent`` starts them (the engine's
list and set-up read before serving).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from processes import wait_live_workers

from lorabus.agents import Agent, AgentConfig, driver_for
from lorabus.bus.connect import close, connect
from lorabus.client import UpdateClient
from lorabus.coordinator import Coordinator, CoordinatorConfig
from lorabus.simfleet import EngineSetup, SimFleet

DEADLINE_S = 20.0

StartFleet = Callable[..., Awaitable[tuple[UpdateClient, SimFleet]]]


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


@contextlib.asynccontextmanager
async def engine_fleets(
    nats_url: str, fleet_name: str, tmp_path: Path
) -> AsyncIterator[StartFleet]:
    """``start(engines, setups, **coordinator)``: a simulated fleet of ``engines``
    (worker id -> kind, world size 1), each engine started as ``setups`` says,
    a coordinator with those settings, and one agent per worker (with
    ``--max-adapters`` as ``max_adapters`` says, by worker); everything stops
    on exit, the coordinator first."""
    async with contextlib.AsyncExitStack() as stack:
        coordinator_tasks: list[asyncio.Task[None]] = []
        agent_tasks: list[asyncio.Task[None]] = []

        async def stop() -> None:
            for group in (coordinator_tasks, agent_tasks):
                for task in group:
                    task.cancel()
                await asyncio.gather(*group, return_exceptions=True)

        async def start(
            engines: Mapping[str, str],
            setups: Mapping[str, EngineSetup],
            *,
            max_adapters: Mapping[str, int] | None = None,
            **coordinator: Any,
        ) -> tuple[UpdateClient, SimFleet]:
            ids = list(engines)
            sim = await stack.enter_async_context(
                SimFleet(ids, [1] * len(ids), engines=list(engines.values()))
            )
            for worker_id, setup in setups.items():
                sim.workers[worker_id].set_setup(**dataclasses.asdict(setup))
            settings = {"phase_timeout_s": 10, "verify_timeout_s": 10, **coordinator}
            config = CoordinatorConfig(
                fleet=fleet_name, frontend_url=sim.url, expected_world_size=len(ids), **settings
            )
            stack.push_async_callback(stop)
            closer = await _serve(
                coordinator_tasks, nats_url, "test-coordinator", Coordinator(config).run
            )
            stack.push_async_callback(closer)
            for worker_id, kind in engines.items():
                agent_config = AgentConfig(
                    fleet=fleet_name,
                    worker_id=worker_id,
                    system_url=sim.system_url(worker_id),
                    frontend_url=sim.url if kind == "dynamo" else "",
                    engine=kind,
                    heartbeat_s=0.2,
                    cache_dir=str(tmp_path / "cache" / worker_id),
                    max_adapters=(max_adapters or {}).get(worker_id, 0),
                )
                driver = driver_for(agent_config)
                stack.push_async_callback(driver.aclose)
                agent = Agent.from_config(agent_config, driver)
                await agent.executor.refresh()  # as `lorabus agent` does before it serves
                closer = await _serve(agent_tasks, nats_url, f"test-agent-{worker_id}", agent.run)
                stack.push_async_callback(closer)
            client = await stack.enter_async_context(
                await UpdateClient.connect(nats_url, fleet_name)
            )
            await wait_live_workers(client, ids)
            return client, sim

        yield start
