"""Stopping everything at once (a node drain, ``compose down``): nats-server,
the coordinator, the agents, a tap and a simulated fleet get SIGTERM
together. Each lorabus process stops promptly and quietly, also when the bus
went away first, and an agent stopped with its engine paused resumes it.

Real processes on a private nats-server, so the test can stop the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable

import httpx
import pytest
from processes import Processes, wait_live_workers

from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from lorabus.simfleet import SimFleet
from lorabus.testbed.child_processes import ChildProcess
from lorabus.testbed.natsserver import NatsServer, free_port

WORKERS = {"w000": 1, "w001": 1}
STOP_DEADLINE_S = 5.0
"""The promise is 2 s; this leaves room for a loaded machine, and still fails
the 5 s and more that draining a vanished bus used to take."""
NOISE = ("Traceback", "never retrieved", "CancelledError")


@pytest.mark.parametrize("bus_first", [False, True], ids=["together", "bus-already-gone"])
async def test_sigterm_to_everything_at_once_stops_each_part_quietly(
    bus_first: bool,
    fleet_name: str,
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
) -> None:
    sim = await start_sim(WORKERS)
    async with NatsServer() as server:
        coordinator = await processes.start_coordinator(
            CoordinatorConfig(fleet=fleet_name, frontend_url=sim.url, expected_world_size=2),
            nats_url=server.url,
        )
        agents = await processes.start_agents(
            WORKERS, sim.system_url, frontend_url=sim.url, fleet=fleet_name, nats_url=server.url
        )
        tap = await processes.start(
            "tap", ["tap", "--follow", "--nats", server.url, "--fleet", fleet_name]
        )
        # A second simulated fleet, as its own process: the agents' engines stay
        # up (in the test's process), so that what is tested here is the stop.
        sim_port = free_port()
        other_sim = await processes.start("sim", ["sim", "--port", str(sim_port)])
        async with await UpdateClient.connect(server.url, fleet_name) as client:
            await wait_live_workers(client, WORKERS, processes=processes)
        await _until_serving(f"http://127.0.0.1:{sim_port}/v1/models")
        # A SIGTERM before the tap's event loop runs would find Python's
        # default handler (-15), not the tap's: it has logged once it runs.
        await _until_logged(tap, "connecting to NATS")
        parts = [coordinator, *agents.values(), tap, other_sim]
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        if bus_first:
            await asyncio.get_running_loop().run_in_executor(None, server.process.wait)
        codes = await _stop_together(parts)

    assert all(code in (0, 130) for code in codes), [
        (p.name, code) for p, code in zip(parts, codes, strict=True)
    ]
    for part in parts:
        log = part.log_tail(400)
        assert not [line for line in log.splitlines() if any(n in line for n in NOISE)], (
            part.describe()
        )


async def _until_serving(url: str) -> None:
    async with httpx.AsyncClient(timeout=1.0) as http, asyncio.timeout(20):
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.1)


async def _until_logged(part: ChildProcess, text: str) -> None:
    async with asyncio.timeout(20):
        while text not in part.log_tail(200):
            assert part.running, part.describe()
            await asyncio.sleep(0.1)


async def _stop_together(parts: list[ChildProcess]) -> list[int]:
    for part in parts:
        part.ended_on_purpose = True
        part.request_stop()
    waits = [asyncio.ensure_future(part.process.wait()) for part in parts]
    _, running = await asyncio.wait(waits, timeout=STOP_DEADLINE_S)
    late = [part for part, wait in zip(parts, waits, strict=True) if wait in running]
    for wait in running:
        wait.cancel()
    assert not late, "still running after SIGTERM:\n" + "\n".join(p.describe() for p in late)
    return [wait.result() for wait in waits]


@pytest.mark.parametrize("bus_first", [False, True], ids=["bus-alive", "bus-stopping-too"])
async def test_an_agent_stopped_with_its_engine_paused_resumes_it(
    bus_first: bool,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
) -> None:
    """w001 has paused (and loaded) while w000's load still runs: an update in
    flight. w001's agent is stopped, alone or with the bus: its engine is
    resumed on its way out, which it can reach whether or not the bus is."""
    sim = await start_sim(WORKERS)
    sim.workers["w000"].set_faults(latency_s={"load": 30.0})
    paused = sim.workers["w001"]
    async with NatsServer() as server:
        await processes.start_coordinator(
            CoordinatorConfig(fleet=fleet_name, frontend_url=sim.url, expected_world_size=2),
            nats_url=server.url,
        )
        agents = await processes.start_agents(
            WORKERS, sim.system_url, frontend_url=sim.url, fleet=fleet_name, nats_url=server.url
        )
        async with await UpdateClient.connect(server.url, fleet_name) as client:
            await wait_live_workers(client, WORKERS, processes=processes)
            update = asyncio.create_task(
                client.update("policy", make_adapter(1), version=1, timeout_s=60)
            )
            try:
                async with asyncio.timeout(20):
                    await paused.wait_until(
                        lambda: paused.paused and paused.count_requests("POST", "/v1/loras") > 0
                    )
                if bus_first:
                    assert server.process is not None
                    server.process.send_signal(signal.SIGTERM)
                codes = await _stop_together([agents["w001"]])
            finally:
                update.cancel()
                await asyncio.gather(update, return_exceptions=True)

    assert codes[0] in (0, 130), agents["w001"].describe()
    assert not paused.paused, "the stopped agent left its engine paused"
    assert paused.count_requests("POST", "/engine/resume_generation") >= 1
