"""Stopping everything at once (a node drain, ``compose down``): nats-server,
the coordinator and the agents get SIGTERM together. Each lorabus process
stops promptly and quietly, also when the bus went away first.

Real processes on a private nats-server, so the test can stop the bus.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import pytest
from processes import Processes, wait_live_workers

from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from lorabus.simfleet import SimFleet
from lorabus.testbed.child_processes import ChildProcess
from lorabus.testbed.natsserver import NatsServer

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
            WORKERS, sim.system_url, fleet=fleet_name, nats_url=server.url
        )
        async with await UpdateClient.connect(server.url, fleet_name) as client:
            await wait_live_workers(client, WORKERS, processes=processes)
        parts = [coordinator, *agents.values()]
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        if bus_first:
            await asyncio.get_running_loop().run_in_executor(None, server.process.wait)
        codes = await _stop_together(parts)

    assert all(code in (0, 130) for code in codes), [p.describe() for p in parts]
    for part in parts:
        log = part.log_tail(400)
        assert not [line for line in log.splitlines() if any(n in line for n in NOISE)], (
            part.describe()
        )


async def _stop_together(parts: list[ChildProcess]) -> list[int]:
    for part in parts:
        part.ended_on_purpose = True
        part.request_stop()
    async with asyncio.timeout(STOP_DEADLINE_S):
        return [await part.process.wait() for part in parts]
