"""Development tools that run a fleet on this machine: ``lorabus up`` and ``lorabus sim``."""

from __future__ import annotations

import sys

import click

from lorabus.agents.config import ENGINE_KINDS
from lorabus.cli.common import EXIT_FAILED, INT_LIST, run
from lorabus.cli.extras import require_sim_extra


def _engine_list(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    engines = [part.strip() for part in value.split(",") if part.strip()]
    unknown = sorted(set(engines) - set(ENGINE_KINDS))
    if not engines or unknown:
        raise click.BadParameter(
            f"use a comma-separated list of {', '.join(ENGINE_KINDS)}, got {value!r}"
        )
    return engines


@click.command()
@click.option("--steps", type=click.IntRange(min=1, max=100), default=3, show_default=True)
@click.option(
    "--world-sizes",
    type=INT_LIST,
    default="2,4,1,1",
    show_default=True,
    help="One world size per simulated worker.",
)
@click.option(
    "--timeline",
    "timeline_path",
    type=click.Path(dir_okay=False, writable=True),
    help="Also draw the run's updates, a row per worker, as one HTML page here.",
)
@click.option(
    "--tenants",
    type=click.IntRange(min=1, max=32),
    default=1,
    show_default=True,
    help="Trainers updating at once, each its own adapter (tenant-1, ...).",
)
def up(steps: int, world_sizes: list[int], timeline_path: str | None, tenants: int) -> None:
    """Run everything on this machine: NATS, a simulated fleet, agents, coordinator, trainer."""
    require_sim_extra()
    from lorabus.testbed.up import run_up

    async def demo() -> int:
        done = await run_up(
            steps, world_sizes, out=click.echo, timeline_path=timeline_path, tenants=tenants
        )
        return 0 if done else EXIT_FAILED

    sys.exit(run(demo))


@click.command()
@click.option("--workers", type=click.IntRange(min=1, max=4096), default=4, show_default=True)
@click.option(
    "--world-sizes",
    type=INT_LIST,
    default="2,4,1",
    show_default=True,
    help="World sizes, cycled over the workers.",
)
@click.option(
    "--engines",
    default="dynamo",
    show_default=True,
    callback=_engine_list,
    help="Engine kinds the workers play (dynamo, vllm, sglang), cycled over the workers.",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8000, show_default=True)
@click.option("--api-key-env", metavar="VAR", help="Require 'Authorization: Bearer $VAR'.")
@click.option(
    "--status-error-quirk",
    is_flag=True,
    help="Answer failed loads with HTTP 200 and status:error, as old releases do.",
)
@click.option(
    "--load-latency",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds each load takes.",
)
def sim(
    workers: int,
    world_sizes: list[int],
    engines: list[str],
    host: str,
    port: int,
    api_key_env: str | None,
    status_error_quirk: bool,
    load_latency: float,
) -> None:
    """Serve a simulated fleet: workers' control servers (Dynamo, vLLM or SGLang) and a frontend."""
    require_sim_extra()
    import os

    from lorabus.simfleet import SimFleet, serve_forever

    api_key = os.environ.get(api_key_env) if api_key_env else None
    fleet = SimFleet.of_size(
        workers, world_sizes, api_key=api_key, load_latency_s=load_latency, engines=engines
    )
    if status_error_quirk:
        for worker in fleet.workers.values():
            worker.set_faults(status_error_quirk=True)

    def ready(started: SimFleet) -> None:
        click.echo(f"frontend {started.url}")
        for worker in started.workers.values():
            click.echo(
                f"worker {worker.worker_id} world_size={worker.world_size} "
                f"engine={worker.engine} system_url={started.system_url(worker.worker_id)}"
            )
        sys.stdout.flush()

    async def serve() -> int:
        await serve_forever(fleet, host, port, ready)
        return 0

    sys.exit(run(serve))
