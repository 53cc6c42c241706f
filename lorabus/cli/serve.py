"""The serving processes: ``lorabus agent`` (one per worker) and ``lorabus coordinator``.

Both run until SIGTERM or SIGINT, and take their settings from the tables in
:mod:`lorabus.cli.flags`.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from lorabus.agents.config import AgentConfig
from lorabus.cli.common import auth_options, fleet_option, headers_from, log, nats_option, run
from lorabus.cli.flags import AGENT_FLAGS, COORDINATOR_FLAGS, build_config, config_options
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.metrics_http import serving

metrics_port_option = click.option(
    "--metrics-port",
    type=click.IntRange(min=1, max=65535),
    default=None,
    help="Serve Prometheus metrics on this port (at /metrics).",
)


@click.command()
@nats_option
@fleet_option
@config_options(AgentConfig, AGENT_FLAGS)
@auth_options
@metrics_port_option
def agent(
    nats_url: str,
    fleet: str,
    api_key_env: str | None,
    headers: tuple[str, ...],
    metrics_port: int | None,
    **settings: Any,
) -> None:
    """Drive one worker's engine on the coordinator's commands."""
    config = build_config(
        AgentConfig,
        AGENT_FLAGS,
        settings,
        fleet=fleet,
        headers=headers_from(api_key_env, headers),
    )
    sys.exit(run(lambda: _serve_agent(config, nats_url, metrics_port)))


async def _serve_agent(config: AgentConfig, nats_url: str, metrics_port: int | None) -> int:
    from lorabus.agents import Agent, driver_for
    from lorabus.agents.metrics import AgentMetrics, InstrumentedDriver
    from lorabus.bus import close, connect
    from lorabus.errors import EngineError

    metrics = AgentMetrics()
    driver = InstrumentedDriver(driver_for(config), metrics)
    agent = Agent.from_config(config, driver)
    try:
        with serving(metrics.registry, metrics_port):
            try:
                await agent.executor.refresh()
            except EngineError as exc:
                log.warning("worker=%s engine not answering at start: %s", config.worker_id, exc)
            nc = await connect(nats_url, name=f"lorabus-agent-{config.worker_id}")
            try:
                await agent.run(nc)
            finally:
                await close(nc)
    finally:
        await driver.aclose()
    return 0


@click.command()
@nats_option
@fleet_option
@config_options(CoordinatorConfig, COORDINATOR_FLAGS)
@auth_options
@metrics_port_option
def coordinator(
    nats_url: str,
    fleet: str,
    api_key_env: str | None,
    headers: tuple[str, ...],
    metrics_port: int | None,
    **settings: Any,
) -> None:
    """Run updates for one fleet (several may run: one leads, the others stand by)."""
    config = build_config(
        CoordinatorConfig,
        COORDINATOR_FLAGS,
        settings,
        fleet=fleet,
        headers=headers_from(api_key_env, headers),
    )
    sys.exit(run(lambda: _serve_coordinator(config, nats_url, metrics_port)))


async def _serve_coordinator(
    config: CoordinatorConfig, nats_url: str, metrics_port: int | None
) -> int:
    from lorabus.bus import close, connect
    from lorabus.coordinator import Coordinator

    nc = await connect(nats_url, name=f"lorabus-coordinator-{config.fleet}")
    service = Coordinator(config)
    try:
        with serving(service.metrics.registry, metrics_port):
            await service.run(nc)
    finally:
        await close(nc)
    return 0
