"""The serving processes: ``lorabus agent`` (one per worker) and ``lorabus coordinator``.

Both run until SIGTERM or SIGINT, and take their settings from the tables in
:mod:`lorabus.service_flags`. Neither exits because NATS is slow or away: each
waits for its bus (:func:`lorabus.bus.connect.wait_connected`), serving its metrics
meanwhile, and exits at once only on what waiting cannot mend (credentials
refused, options that would expose them).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import click

from lorabus.agents.config import AgentConfig
from lorabus.bus.connect import Bus
from lorabus.bus.options import BusOptions
from lorabus.cli.common import auth_options, bus_options, fleet_option, headers_from, log, run
from lorabus.cli.headers import auth_headers
from lorabus.cli.metrics_http import serving
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.runtime.event_loop import serving_loop_factory, settle_collector
from lorabus.service_flags import (
    AGENT_FLAGS,
    COORDINATOR_FLAGS,
    Flag,
    build_config,
    config_options,
)

_Config = TypeVar("_Config", AgentConfig, CoordinatorConfig)

metrics_port_option = click.option(
    "--metrics-port",
    type=click.IntRange(min=1, max=65535),
    default=None,
    help="Serve Prometheus metrics on this port (at /metrics).",
)
admin_key_option = click.option(
    "--admin-api-key-env",
    metavar="VAR",
    help="SGLang with --admin-api-key: send 'Authorization: Bearer $VAR' on its control "
    "routes (pause, continue, load, unload) and the --api-key-env key on /v1/models.",
)


def serving_command(
    config_type: type[_Config], flags: Sequence[Flag], *, admin_key: bool = False
) -> Callable[[Callable[[_Config, Bus, int | None], Awaitable[int]]], click.Command]:
    """A serving process's command: the bus and auth options (with ``admin_key``,
    ``--admin-api-key-env`` too), the flags of its config, ``--metrics-port``;
    the decorated coroutine runs with the config until a signal stops it, and
    its docstring is the command's help."""

    def decorate(serve: Callable[[_Config, Bus, int | None], Awaitable[int]]) -> click.Command:
        def command(
            nats_url: str,
            bus: BusOptions,
            fleet: str,
            api_key_env: str | None,
            headers: tuple[str, ...],
            metrics_port: int | None,
            admin_api_key_env: str | None = None,
            **settings: Any,
        ) -> None:
            fixed: dict[str, Any] = {}
            if admin_api_key_env is not None:
                fixed["admin_headers"] = auth_headers(admin_api_key_env)
            config = build_config(
                config_type,
                flags,
                settings,
                fleet=fleet,
                headers=headers_from(api_key_env, headers),
                **fixed,
            )
            if not (click.get_current_context().find_root().obj or {}).get("log_level_given"):
                # A service says when it is ready and what each update did;
                # the other commands stay quiet unless asked.
                logging.getLogger("lorabus").setLevel(logging.INFO)
            settle_collector()
            try:
                loop_factory = serving_loop_factory()
            except ValueError as exc:
                raise click.UsageError(str(exc)) from exc
            sys.exit(
                run(
                    lambda: serve(config, Bus(nats_url, bus), metrics_port),
                    loop_factory=loop_factory,
                )
            )

        options = [bus_options(), fleet_option, config_options(config_type, flags), auth_options]
        options += [admin_key_option] if admin_key else []
        options.append(metrics_port_option)
        for option in reversed(options):
            command = option(command)
        return click.command(name=serve.__name__, help=serve.__doc__)(command)

    return decorate


@serving_command(AgentConfig, AGENT_FLAGS, admin_key=True)
async def agent(config: AgentConfig, bus: Bus, metrics_port: int | None) -> int:
    """Drive one worker's engine on the coordinator's commands."""
    from lorabus.agents import Agent, driver_for
    from lorabus.agents.metrics import AgentMetrics, instrumented
    from lorabus.bus.connect import close
    from lorabus.errors import BadRequest, EngineError

    metrics = AgentMetrics()
    driver = instrumented(driver_for(config), metrics)
    agent = Agent.from_config(config, driver)
    cache = agent.executor.adapter_cache
    try:
        if cache is not None:
            cache.check_writable()
    except (OSError, ValueError) as exc:
        await driver.aclose()
        raise BadRequest(
            f"worker={config.worker_id} cannot keep adapters in its cache: {exc} "
            "(give --cache-dir a directory this agent may write)"
        ) from exc
    if not agent.verifier.required:
        log.warning(
            "worker=%s checks no command signatures: any client allowed to publish on its "
            "command subjects can drive its engine (give --coordinator-key or --trust-file)",
            config.worker_id,
        )
    try:
        with serving(metrics.registry, metrics_port):
            try:
                # Also asks whether the engine can take LoRA updates at all: the
                # executor logs what it lacks, and the heartbeats say it.
                await agent.executor.refresh()
            except EngineError as exc:
                log.warning("worker=%s engine not answering at start: %s", config.worker_id, exc)
            await agent.resume_left_paused()
            nc = await bus.wait_connected(
                f"lorabus-agent-{config.worker_id}", who=f"worker={config.worker_id}"
            )
            metrics.bus_connected.set_function(lambda: nc.is_connected)
            try:
                await agent.run(nc)
            finally:
                await close(nc)
    finally:
        await driver.aclose()
    return 0


@serving_command(CoordinatorConfig, COORDINATOR_FLAGS)
async def coordinator(config: CoordinatorConfig, bus: Bus, metrics_port: int | None) -> int:
    """Run updates for one fleet (several may run: one leads, the others stand by)."""
    from lorabus.bus.connect import close
    from lorabus.coordinator import Coordinator

    service = Coordinator(config)
    with serving(service.metrics.registry, metrics_port):
        nc = await bus.wait_connected(
            f"lorabus-coordinator-{config.fleet}",
            who=f"coordinator {service.holder} of fleet {config.fleet}",
        )
        try:
            await service.run(nc)
        finally:
            await close(nc)
    return 0
