"""The serving processes: ``lorabus agent`` (one per worker) and ``lorabus coordinator``.

Both run until SIGTERM or SIGINT, and take their settings from the tables in
:mod:`lorabus.service_flags`. Neither exits because NATS is slow or away: each
waits for its bus (:func:`lorabus.bus.connect.wait_connected`), serving its metrics
meanwhile, and exits at once only on what waiting cannot mend (credentials
refused, options that would expose them).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

from lorabus.agents.config import AgentConfig
from lorabus.agents.node_config import NodeConfig, load_node_config
from lorabus.bus.connect import Bus
from lorabus.bus.options import BusOptions
from lorabus.cli.common import auth_options, bus_options, fleet_option, headers_from, log, run
from lorabus.cli.headers import auth_headers
from lorabus.cli.metrics_http import serving
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.runtime.event_loop import serving_loop_factory, settle_collector
from lorabus.schemas.nodes import NODE_ENV
from lorabus.service_flags import (
    AGENT_FLAGS,
    COORDINATOR_FLAGS,
    Flag,
    build_config,
    config_options,
)

_Config = TypeVar("_Config", AgentConfig, CoordinatorConfig)

if TYPE_CHECKING:
    from lorabus.agents import Agent
    from lorabus.agents.metrics import AgentMetrics

metrics_port_option = click.option(
    "--metrics-port",
    type=click.IntRange(min=1, max=65535),
    default=None,
    help="Serve Prometheus metrics on this port (at /metrics).",
)
node_file_option = click.option(
    "--node-file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Drive every worker of this node, as the TOML file lists them, on one "
    "connection and identity (docs/operations.md, 'One agent per node').",
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
            fixed.update(fleet=fleet, headers=headers_from(api_key_env, headers))
            node_file = settings.pop("node_file", None)
            config: Any
            if node_file is not None:
                config = _node_config(node_file, settings, fixed, headers)
            else:
                if admin_key and os.environ.get(NODE_ENV):  # the agent, as a node's identity
                    raise click.UsageError(
                        f"this identity is that of node {os.environ[NODE_ENV]!r} "
                        f"(${NODE_ENV}): give its workers with --node-file, or a worker's identity"
                    )
                _check_given(flags, settings)
                config = build_config(config_type, flags, settings, **fixed)
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
        options += [admin_key_option, node_file_option] if admin_key else []
        options.append(metrics_port_option)
        for option in reversed(options):
            command = option(command)
        return click.command(name=serve.__name__, help=serve.__doc__)(command)

    return decorate


def _check_given(flags: Sequence[Flag], settings: dict[str, Any]) -> None:
    """A usage error for a flag the config needs that was left out (an
    agent's ``--worker-id`` and ``--system-url`` are optional only with
    ``--node-file``)."""
    for flag in flags:
        if flag.optional and settings.get(flag.field) is None:
            raise click.UsageError(
                f"Missing option '{flag.name}' (or give the workers with --node-file)"
            )


def _node_config(
    path: str, settings: dict[str, Any], fixed: dict[str, Any], headers: tuple[str, ...]
) -> NodeConfig:
    """The node ``path`` lists, each worker over the command line's settings;
    a worker's own key variable takes the place of ``--api-key-env``, beside
    the ``--header`` flags (``headers``), as it would on the command line."""
    for own in ("worker_id", "system_url"):
        if settings.get(own) is not None:
            raise click.UsageError(
                f"--node-file lists each worker's {own.replace('_', '-')}: leave out the flag"
            )
    base = {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in settings.items()
        if value is not None
    }
    base.update(fixed)
    try:
        node = load_node_config(
            path,
            base,
            lambda var: headers_from(var, headers),
            auth_headers,  # as --admin-api-key-env: the admin key alone
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    identity_node = os.environ.get(NODE_ENV)
    if identity_node and identity_node != node.node:
        # Its acks and beats would go out on subjects its identity may not
        # publish on: the workers would only look dead.
        raise click.UsageError(
            f"node file {path} names node {node.node!r}, but this identity is that of "
            f"node {identity_node!r} (${NODE_ENV}): give the node file of this node, or "
            "this node's identity (--identity)"
        )
    return node


@serving_command(AgentConfig, AGENT_FLAGS, admin_key=True)
async def agent(config: AgentConfig | NodeConfig, bus: Bus, metrics_port: int | None) -> int:
    """Drive one worker's engine on the coordinator's commands (with
    --node-file, every worker of a node, on one connection)."""
    from lorabus.agents.metrics import AgentMetrics
    from lorabus.agents.node import NodeAgent
    from lorabus.bus.connect import close

    metrics = AgentMetrics()
    workers = config.workers if isinstance(config, NodeConfig) else [config]
    agents: list[Agent] = []
    try:
        for worker in workers:
            agents.append(await _agent_of(worker, metrics))
        with serving(metrics.registry, metrics_port):
            for one in agents:
                await _start_engine(one)
            name, who = (
                (f"lorabus-node-{config.node}", f"node={config.node}")
                if isinstance(config, NodeConfig)
                else (f"lorabus-agent-{config.worker_id}", f"worker={config.worker_id}")
            )
            nc = await bus.wait_connected(name, who=who)
            metrics.bus_connected.set_function(lambda: nc.is_connected)
            try:
                if isinstance(config, NodeConfig):
                    await NodeAgent(config.node, agents).run(nc)
                else:
                    await agents[0].run(nc)
            finally:
                await close(nc)
    finally:
        for one in agents:
            await one.executor.driver.aclose()
    return 0


async def _agent_of(config: AgentConfig, metrics: AgentMetrics) -> Agent:
    """The agent of one worker, its cache checked (BadRequest if unusable)."""
    from lorabus.agents import Agent, driver_for
    from lorabus.agents.metrics import instrumented
    from lorabus.errors import BadRequest

    driver = instrumented(driver_for(config), metrics, config.worker_id)
    agent = Agent.from_config(config, driver)
    cache = agent.executor.store_loads.adapter_cache
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
    return agent


async def _start_engine(agent: Agent) -> None:
    """Ask the engine what it can do, and resume it if a predecessor left it paused."""
    from lorabus.errors import EngineError

    try:
        # Also asks whether the engine can take LoRA updates at all: the
        # executor logs what it lacks, and the heartbeats say it.
        await agent.executor.refresh()
    except EngineError as exc:
        log.warning("worker=%s engine not answering at start: %s", agent.worker_id, exc)
    await agent.resume_left_paused()


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
