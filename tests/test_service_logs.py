"""What a service says at the default log level: one line when it is ready,
one per update, and no line per HTTP request (those only at DEBUG)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from processes import Processes, wait_live_workers

from lorabus.agents import AgentConfig
from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from lorabus.service_flags import agent_args, coordinator_args
from lorabus.simfleet import SimFleet
from lorabus.testbed.child_processes import LORABUS, ChildProcess, child_env


async def test_services_say_when_they_are_ready_and_what_each_update_did(
    nats_url: str,
    fleet_name: str,
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
    make_adapter: Callable[[int], str],
) -> None:
    sim = await start_sim({"w000": 1})
    coordinator_config = CoordinatorConfig(
        fleet=fleet_name, frontend_url=sim.url, expected_world_size=1
    )
    agent_config = AgentConfig(
        fleet=fleet_name,
        worker_id="w000",
        system_url=sim.system_url("w000"),
        frontend_url=sim.url,
        heartbeat_s=0.2,
    )
    # No --log-level: the default, as an operator starts them.
    coordinator = await _start(
        processes, "coordinator", coordinator_args(coordinator_config, nats_url=nats_url)
    )
    agent = await _start(processes, "agent", agent_args(agent_config, nats_url=nats_url))
    async with await UpdateClient.connect(nats_url, fleet_name) as client:
        await wait_live_workers(client, ["w000"], processes=processes)
        result = await client.update("policy", make_adapter(1), version=1, update_id="step-1")
    await processes.stop_all([agent, coordinator])

    assert result.committed, result.error
    coordinator_log, agent_log = coordinator.log_tail(200), agent.log_tail(200)
    assert "ready on fleet" in coordinator_log, coordinator_log
    assert "update=step-1 committed policy-v1" in coordinator_log, coordinator_log
    assert "agent ready on fleet" in agent_log, agent_log
    assert "update=step-1 resumed; engine serves policy-v1" in agent_log, agent_log
    assert "HTTP Request" not in agent_log + coordinator_log
    # Where uvloop is installed (a dependency off Windows), services run on it.
    assert "(event loop: uvloop)" in coordinator_log, coordinator_log
    assert "(event loop: uvloop)" in agent_log, agent_log


async def _start(processes: Processes, name: str, args: list[str]) -> ChildProcess:
    child = await ChildProcess.spawn(
        name, [LORABUS, *args], processes.log_dir / f"{name}.log", env=child_env()
    )
    return processes.adopt(child)
