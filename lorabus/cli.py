"""The ``lorabus`` command line: one subcommand per part, plus ``up``.

Exit codes: 0 success (an update committed), 1 failure (an update failed, a
service died), 2 bad usage (click's convention for usage errors).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import click

from lorabus.bus import BusUnreachable
from lorabus.metrics_http import serving
from lorabus.natsserver import NatsServerMissing
from lorabus.options import auth_headers

log = logging.getLogger("lorabus")

NATS_OPTION = click.option(
    "--nats",
    "nats_url",
    envvar="LORABUS_NATS_URL",
    required=True,
    show_envvar=True,
    help="NATS server URL.",
)
FLEET_OPTION = click.option(
    "--fleet",
    envvar="LORABUS_FLEET",
    default="default",
    show_default=True,
    show_envvar=True,
    help="Fleet name; many fleets can share one NATS.",
)


def _auth_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = click.option(
        "--header",
        "headers",
        multiple=True,
        metavar="NAME=VALUE",
        help="Extra HTTP header on every call (repeatable).",
    )(func)
    return click.option(
        "--api-key-env",
        metavar="VAR",
        help="Send 'Authorization: Bearer $VAR' (unless unset or EMPTY).",
    )(func)


def _headers(api_key_env: str | None, headers: tuple[str, ...]) -> dict[str, str]:
    try:
        return auth_headers(api_key_env, headers)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--header") from exc


def _run(main: Callable[[], Awaitable[int]]) -> int:
    """Run ``main`` until it returns, or until SIGTERM/SIGINT cancels it cleanly."""

    async def guarded() -> int:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await main()
        except asyncio.CancelledError:
            log.info("stopped by signal")
            return 130
        except (BusUnreachable, NatsServerMissing) as exc:
            click.echo(f"error: {exc}", err=True)
            return 1

    return asyncio.run(guarded())


@click.group()
@click.option(
    "--log-level",
    default="WARNING",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
def main(log_level: str) -> None:
    """lorabus: roll LoRA adapters out across inference workers over NATS."""
    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@main.command()
def schema() -> None:
    """Print the JSON Schema of every wire message."""
    from schemas import json_schema

    click.echo(json.dumps(json_schema(), indent=2))


@main.command()
@NATS_OPTION
@FLEET_OPTION
@click.option(
    "--follow/--no-follow",
    default=True,
    show_default=True,
    help="Keep printing new records, or stop once caught up.",
)
@click.option(
    "--from-seq", type=click.IntRange(min=1), default=None, help="Start at this stream sequence."
)
@click.option(
    "--since",
    type=click.DateTime(),
    default=None,
    help="Start at this local time, e.g. 2026-11-30T14:05:00.",
)
@click.option(
    "--durable",
    default=None,
    help="Consumer name that remembers the position across runs and restarts.",
)
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Append JSON lines to this file instead of printing a timeline.",
)
def tap(
    nats_url: str,
    fleet: str,
    follow: bool,
    from_seq: int | None,
    since: datetime.datetime | None,
    durable: str | None,
    out_path: str | None,
) -> None:
    """Follow or replay the fleet's audit trail (commands, acks, events)."""
    from lorabus.tap import AuditStreamMissing, Tap
    from lorabus.trail_file import TrailWriter, last_seq_in
    from schemas import Subjects

    async def run() -> int:
        from lorabus.bus import close, connect

        nc = await connect(nats_url, name=f"lorabus-tap-{fleet}")
        after = last_seq_in(out_path) if out_path else 0
        reader = Tap(
            nc,
            Subjects(fleet=fleet),
            durable=durable,
            start_seq=from_seq,
            start_time=since,
            after_seq=after,
        )
        try:
            with TrailWriter(out_path, echo=click.echo) as writer:
                await reader.run(writer.write, follow=follow)
        except AuditStreamMissing as exc:
            click.echo(f"error: {exc}", err=True)
            return 1
        finally:
            await close(nc)
        return 0

    sys.exit(_run(run))


@main.group()
def audit() -> None:
    """Check an audit trail against lorabus's promises."""


@audit.command("verify")
@click.argument("trail", type=click.Path(exists=True, dir_okay=False), required=False)
@click.option("--live", is_flag=True, help="Check the fleet's audit stream as it is now.")
@click.option(
    "--nats",
    "nats_url",
    envvar="LORABUS_NATS_URL",
    default=None,
    help="NATS server URL (with --live).",
)
@FLEET_OPTION
def audit_verify(trail: str | None, live: bool, nats_url: str | None, fleet: str) -> None:
    """Verify a trail written by 'lorabus tap --out' (or, with --live, the stream).

    Lists each violation with the stream sequences of the records that show it;
    exits 1 when there is any.
    """
    from lorabus.audit import TrailRecord, verify
    from lorabus.tap import AuditStreamMissing, Tap
    from lorabus.trail_file import read_trail
    from schemas import Subjects

    if live == (trail is not None):
        raise click.UsageError("give either a TRAIL file or --live")
    if live and not nats_url:
        raise click.UsageError("--live needs --nats (or $LORABUS_NATS_URL)")

    async def check() -> int:
        records: list[TrailRecord] = []
        if trail is not None:
            records = read_trail(trail)
        else:
            from lorabus.bus import close, connect

            assert nats_url is not None
            nc = await connect(nats_url, name=f"lorabus-audit-{fleet}")

            async def keep(record: TrailRecord) -> None:
                records.append(record)

            try:
                await Tap(nc, Subjects(fleet=fleet)).run(keep, follow=False)
            except AuditStreamMissing as exc:
                click.echo(f"error: {exc}", err=True)
                return 1
            finally:
                await close(nc)
        violations = verify(records)
        for violation in violations:
            click.echo(f"{violation.rule}: {violation.message} (records {violation.seqs})")
        click.echo(f"audit: {len(records)} records, {len(violations)} violation(s)")
        return 1 if violations else 0

    sys.exit(_run(check))


@main.command()
@NATS_OPTION
@FLEET_OPTION
@click.option("--worker-id", required=True, help="Stable identity; orders the rank map.")
@click.option("--engine", type=click.Choice(["dynamo"]), default="dynamo", show_default=True)
@click.option("--system-url", required=True, help="The worker's system server base URL.")
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="The engine's world size (tensor x pipeline parallel).",
)
@_auth_options
@click.option("--heartbeat-s", type=click.FloatRange(min=0.05), default=1.0, show_default=True)
@click.option(
    "--engine-timeout",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    help="Seconds for one engine HTTP call.",
)
@click.option(
    "--max-pause-lease",
    type=click.FloatRange(min=0.5),
    default=None,
    help="Resume the engine on its own after this long paused without a renewal, "
    "whatever lease the coordinator asked for (default: the coordinator's lease).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(min=1, max=65535),
    default=None,
    help="Serve Prometheus metrics on this port (at /metrics).",
)
def agent(
    nats_url: str,
    fleet: str,
    worker_id: str,
    engine: str,
    system_url: str,
    world_size: int,
    api_key_env: str | None,
    headers: tuple[str, ...],
    heartbeat_s: float,
    engine_timeout: float,
    max_pause_lease: float | None,
    metrics_port: int | None,
) -> None:
    """Drive one worker's engine on the coordinator's commands."""
    from agents import Agent, CommandExecutor, DynamoDriver
    from agents.metrics import AgentMetrics, InstrumentedDriver
    from schemas import EngineError, Subjects, check_token

    try:
        check_token("worker id", worker_id)
        subjects = Subjects(fleet=fleet)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    header_map = _headers(api_key_env, headers)

    async def serve() -> int:
        from lorabus.bus import close, connect

        metrics = AgentMetrics()
        driver = InstrumentedDriver(
            DynamoDriver(system_url, headers=header_map, timeout_s=engine_timeout), metrics
        )
        executor = CommandExecutor(worker_id, world_size, driver)
        try:
            with serving(metrics.registry, metrics_port):
                try:
                    await executor.refresh()
                except EngineError as exc:
                    log.warning("worker=%s engine not answering at start: %s", worker_id, exc)
                nc = await connect(nats_url, name=f"lorabus-agent-{worker_id}")
                try:
                    await Agent(
                        subjects,
                        executor,
                        heartbeat_s=heartbeat_s,
                        max_pause_lease_s=max_pause_lease,
                    ).run(nc)
                finally:
                    await close(nc)
        finally:
            await driver.aclose()
        return 0

    sys.exit(_run(serve))


@main.command()
@NATS_OPTION
@FLEET_OPTION
@click.option("--frontend-url", required=True, help="Dynamo frontend base URL.")
@click.option(
    "--expected-world-size",
    type=int,
    required=True,
    help="Sum of the workers' world sizes an update waits for.",
)
@click.option(
    "--phase-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds for every member to ack one phase.",
)
@click.option(
    "--verify-timeout",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds for the frontend to list the new adapter.",
)
@click.option(
    "--quorum-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds for live world sizes to reach the expected sum.",
)
@click.option(
    "--quorum",
    default="all",
    show_default=True,
    callback=lambda _c, _p, v: _quorum(v),
    help="'all', or the fraction of the expected world size an update needs; below "
    "all, workers that fail are left out of the commit and its rank map.",
)
@click.option(
    "--keep",
    type=int,
    default=2,
    show_default=True,
    help="Versions of an adapter kept loaded after a commit.",
)
@click.option(
    "--naming", type=click.Choice(["versioned", "fixed"]), default="versioned", show_default=True
)
@click.option(
    "--adapter-root",
    "adapter_roots",
    multiple=True,
    help="Accept adapter paths only under this directory (repeatable).",
)
@_auth_options
@click.option(
    "--pause-lease",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds an agent stays paused without a renewal before resuming on its own.",
)
@click.option(
    "--leader-lease",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds of silence after which a standby coordinator takes over.",
)
@click.option("--holder", default="", help="This coordinator's name (default: host-pid-random).")
@click.option(
    "--kv-replicas",
    type=int,
    default=1,
    show_default=True,
    help="Replicas of the fleet's KV buckets (3 on a three-node NATS cluster).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(min=1, max=65535),
    default=None,
    help="Serve Prometheus metrics on this port (at /metrics).",
)
@click.option(
    "--audit-max-age",
    type=click.FloatRange(min=60),
    default=7 * 24 * 3600.0,
    show_default=True,
    help="Seconds the audit stream keeps records.",
)
@click.option(
    "--audit-max-bytes",
    type=click.IntRange(min=1 << 20),
    default=1 << 30,
    show_default=True,
    help="Bytes the audit stream may hold before dropping its oldest records.",
)
def coordinator(
    nats_url: str,
    fleet: str,
    frontend_url: str,
    expected_world_size: int,
    phase_timeout: float,
    verify_timeout: float,
    quorum_timeout: float,
    keep: int,
    naming: str,
    adapter_roots: tuple[str, ...],
    api_key_env: str | None,
    headers: tuple[str, ...],
    quorum: float,
    pause_lease: float,
    leader_lease: float,
    holder: str,
    kv_replicas: int,
    metrics_port: int | None,
    audit_max_age: float,
    audit_max_bytes: int,
) -> None:
    """Run updates for one fleet (several may run: one leads, the others stand by)."""
    from coordinator import Coordinator, CoordinatorConfig
    from schemas import Naming

    try:
        config = CoordinatorConfig(
            fleet=fleet,
            frontend_url=frontend_url,
            expected_world_size=expected_world_size,
            phase_timeout_s=phase_timeout,
            verify_timeout_s=verify_timeout,
            quorum_timeout_s=quorum_timeout,
            quorum=quorum,
            keep=keep,
            naming=Naming(naming),
            headers=_headers(api_key_env, headers),
            adapter_roots=list(adapter_roots),
            pause_lease_s=pause_lease,
            leader_lease_s=leader_lease,
            holder=holder,
            kv_replicas=kv_replicas,
            audit_max_age_s=audit_max_age,
            audit_max_bytes=audit_max_bytes,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc

    async def serve() -> int:
        from lorabus.bus import close, connect

        nc = await connect(nats_url, name=f"lorabus-coordinator-{fleet}")
        service = Coordinator(config)
        try:
            with serving(service.metrics.registry, metrics_port):
                await service.run(nc)
        finally:
            await close(nc)
        return 0

    sys.exit(_run(serve))


@main.command()
@NATS_OPTION
@FLEET_OPTION
@click.option("--adapter", required=True, help="Adapter name (served as <name>-v<version>).")
@click.option("--path", required=True, help="Absolute adapter directory, as workers see it.")
@click.option(
    "--version",
    type=click.IntRange(min=0),
    default=None,
    help="Policy version; default: one past the committed version.",
)
@click.option("--update-id", default=None, help="Reuse to fetch the result of an earlier request.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=300.0,
    show_default=True,
    help="Seconds to wait for the result.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def update(
    nats_url: str,
    fleet: str,
    adapter: str,
    path: str,
    version: int | None,
    update_id: str | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Request an update and wait for its result (exit 0 committed, 1 failed)."""
    from lorabus.client import UpdateClient
    from lorabus.render import result_text
    from schemas import Subjects, to_builtins

    try:
        Subjects(fleet=fleet)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc

    async def request() -> int:
        async with await UpdateClient.connect(nats_url, fleet) as client:
            result = await client.update(
                adapter, path, version=version, update_id=update_id, timeout_s=timeout
            )
        click.echo(json.dumps(to_builtins(result)) if as_json else result_text(result))
        return 0 if result.committed else 1

    sys.exit(_run(request))


@main.command()
@NATS_OPTION
@FLEET_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON object.")
@click.option("--watch", is_flag=True, help="Redraw the status until Ctrl-C.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds between redraws with --watch.",
)
def status(nats_url: str, fleet: str, as_json: bool, watch: bool, interval: float) -> None:
    """Show members, world sizes, rank offsets, paused state, adapters, the update in flight."""
    from lorabus.client import CoordinatorUnavailable, UpdateClient
    from lorabus.render import status_text
    from schemas import to_builtins

    async def ask() -> int:
        async with await UpdateClient.connect(nats_url, fleet) as client:
            while True:
                try:
                    fleet_status = await client.status()
                    text = (
                        json.dumps(to_builtins(fleet_status))
                        if as_json
                        else status_text(fleet_status)
                    )
                except CoordinatorUnavailable as exc:
                    if not watch:
                        click.echo(f"error: {exc}", err=True)
                        return 1
                    text = f"waiting for a coordinator: {exc}"
                if not watch:
                    click.echo(text)
                    return 0
                if not as_json:
                    click.clear()
                click.echo(text)
                await asyncio.sleep(interval)

    sys.exit(_run(ask))


def _quorum(value: str) -> float:
    if value == "all":
        return 1.0
    try:
        fraction = float(value)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise click.BadParameter("use 'all' or a fraction in (0, 1], e.g. 0.75")
    return fraction


def _world_sizes(_ctx: object, _param: object, value: str) -> list[int]:
    try:
        sizes = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise click.BadParameter("give positive integers separated by commas, e.g. 2,4,1")
    return sizes


@main.command()
@click.option("--workers", type=click.IntRange(min=1, max=4096), default=4, show_default=True)
@click.option(
    "--world-sizes",
    default="2,4,1",
    show_default=True,
    callback=_world_sizes,
    help="World sizes, cycled over the workers.",
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
    host: str,
    port: int,
    api_key_env: str | None,
    status_error_quirk: bool,
    load_latency: float,
) -> None:
    """Serve a simulated Dynamo fleet: workers' system servers and a frontend."""
    import os

    from simfleet import SimFleet, serve_forever

    api_key = os.environ.get(api_key_env) if api_key_env else None
    fleet = SimFleet.of_size(workers, world_sizes, api_key=api_key, load_latency_s=load_latency)
    if status_error_quirk:
        for worker in fleet.workers.values():
            worker.set_faults(status_error_quirk=True)

    def ready(started: SimFleet) -> None:
        click.echo(f"frontend {started.url}", err=False)
        for worker in started.workers.values():
            click.echo(
                f"worker {worker.worker_id} world_size={worker.world_size} "
                f"system_url={started.system_url(worker.worker_id)}"
            )
        sys.stdout.flush()

    async def serve() -> int:
        await serve_forever(fleet, host, port, ready)
        return 0

    sys.exit(_run(serve))


@main.command()
@click.option("--steps", type=click.IntRange(min=1, max=100), default=3, show_default=True)
@click.option(
    "--world-sizes",
    default="2,4,1,1",
    show_default=True,
    callback=_world_sizes,
    help="One world size per simulated worker.",
)
def up(steps: int, world_sizes: list[int]) -> None:
    """Run everything on this machine: NATS, a simulated fleet, agents, coordinator, trainer."""
    from lorabus.up import run_up

    async def demo() -> int:
        return 0 if await run_up(steps, world_sizes, out=click.echo) else 1

    sys.exit(_run(demo))


def _sizes(_ctx: object, _param: object, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        sizes = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise click.BadParameter("give positive integers separated by commas, e.g. 8,64,256")
    return sizes


def _window_case(_ctx: object, _param: object, value: str | None) -> str | None:
    if value is None or value == "off":
        return value
    try:
        n, latency, jitter = value.split(":")
        int(n), float(latency), float(jitter)
    except ValueError:
        raise click.BadParameter("use N:LATENCY:JITTER, e.g. 256:0.2:0.05, or 'off'") from None
    return value


@main.command()
@click.option(
    "--quick",
    is_flag=True,
    help="Sizes up to 256, fewer updates, own connections only, no window case.",
)
@click.option(
    "--sizes", callback=_sizes, help="Fleet sizes [default: 8,64,256,1024; quick 8,64,256]."
)
@click.option(
    "--updates",
    type=click.IntRange(min=1),
    default=None,
    help="Timed updates per size and mode [default: 20; quick 5].",
)
@click.option(
    "--world-sizes",
    default="2,4,1,1",
    show_default=True,
    callback=_world_sizes,
    help="World sizes, cycled over the workers.",
)
@click.option(
    "--load-latency",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds each simulated load takes.",
)
@click.option(
    "--load-jitter",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Each load takes latency +- up to this, drawn per worker and update.",
)
@click.option(
    "--window-case",
    callback=_window_case,
    help="Also run N with realistic loads, N:LATENCY:JITTER, or 'off' "
    "[default: 256:0.2:0.05; quick: off].",
)
@click.option(
    "--modes",
    default="floor,null,http,baseline",
    show_default=True,
    help="Which of floor, null, http, baseline to run.",
)
@click.option(
    "--connections",
    default=None,
    help="Agents' NATS connections for floor and null: own, shared or both "
    "[default: own,shared; quick: own].",
)
@click.option(
    "--agent-procs",
    type=click.IntRange(min=1, max=64),
    default=4,
    show_default=True,
    help="Processes the agents are spread over.",
)
@click.option(
    "--heartbeat-s",
    type=click.FloatRange(min=0.05),
    default=None,
    help="Agents' heartbeat interval [default: max(1, N/128)].",
)
@click.option(
    "--keep",
    type=click.IntRange(min=1),
    default=None,
    help="The coordinator's --keep [default: every version of the run, as the "
    "baseline unloads nothing; 2 measures retiring too].",
)
@click.option(
    "--out", "out_path", type=click.Path(dir_okay=False), help="Write the figures as JSON."
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False),
    help="Keep every process's log here (default: a temporary dir, kept on failure).",
)
def bench(
    quick: bool,
    sizes: list[int] | None,
    updates: int | None,
    world_sizes: list[int],
    load_latency: float,
    load_jitter: float,
    window_case: str | None,
    modes: str,
    connections: str | None,
    agent_procs: int,
    heartbeat_s: float | None,
    keep: int | None,
    out_path: str | None,
    run_dir: str | None,
) -> None:
    """Measure updates: lorabus (null and HTTP engines), direct HTTP, and the bare bus."""
    from pathlib import Path

    from lorabus.bench import BenchConfig, BenchReport, WindowCase, report_json, run_bench, table
    from lorabus.bench.config import FULL_SIZES, QUICK_SIZES

    window: WindowCase | None = None if quick else WindowCase()
    if window_case == "off":
        window = None
    elif window_case is not None:
        n, latency, jitter = window_case.split(":")
        window = WindowCase(int(n), float(latency), float(jitter))
    try:
        config = BenchConfig(
            sizes=tuple(sizes or (QUICK_SIZES if quick else FULL_SIZES)),
            updates=updates or (5 if quick else 20),
            warmup=1 if quick else 2,
            world_sizes=tuple(world_sizes),
            load_latency_s=load_latency,
            load_jitter_s=load_jitter,
            window_case=window,
            modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
            connections=tuple(
                c.strip()
                for c in (connections or ("own" if quick else "own,shared")).split(",")
                if c.strip()
            ),
            agent_procs=agent_procs,
            heartbeat_s=heartbeat_s,
            keep=keep,
            idle_s=0.5 if quick else 2.0,
            run_dir=Path(run_dir) if run_dir else None,
            label="quick" if quick else "full",
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc

    reports: list[BenchReport] = []

    async def go() -> int:
        reports.append(await run_bench(config, out=lambda line: click.echo(line, err=True)))
        return 0

    code = _run(go)
    if not reports:
        sys.exit(code)
    report = reports[0]
    for line in table(report):
        click.echo(line)
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_bytes(report_json(report) + b"\n")
    sys.exit(1 if report.unmeasured else 0)


@main.command()
@click.option(
    "--duration",
    type=click.FloatRange(min=1),
    default=60.0,
    show_default=True,
    help="Seconds of updates under faults (then every fault is healed and checked).",
)
@click.option("--seed", type=int, default=1, show_default=True, help="Seeds the fault schedule.")
@click.option("--workers", type=click.IntRange(min=1, max=64), default=4, show_default=True)
@click.option(
    "--world-sizes",
    default="2,1,4,1",
    show_default=True,
    callback=_world_sizes,
    help="World sizes, cycled over the workers.",
)
@click.option(
    "--fault-gap",
    type=click.FloatRange(min=0.5),
    default=4.0,
    show_default=True,
    help="Mean seconds between the starts of two faults.",
)
@click.option(
    "--out", "out_path", type=click.Path(dir_okay=False), help="Write the run's figures as JSON."
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False),
    help="Keep logs, NATS store and adapters here (default: a temporary dir, kept on violations).",
)
def chaos(
    duration: float,
    seed: int,
    workers: int,
    world_sizes: list[int],
    fault_gap: float,
    out_path: str | None,
    run_dir: str | None,
) -> None:
    """Run updates while a seeded schedule kills, stops and slows the fleet; check invariants."""
    from pathlib import Path

    from lorabus.chaos import ChaosConfig, ChaosReport, report_json, run_chaos

    if logging.getLogger().level > logging.INFO:
        # Its own connection's warnings while the nats-server restarts on purpose.
        logging.getLogger("lorabus.bus").setLevel(logging.ERROR)
    config = ChaosConfig(
        duration_s=duration,
        seed=seed,
        world_sizes=[world_sizes[i % len(world_sizes)] for i in range(workers)],
        mean_gap_s=fault_gap,
        run_dir=Path(run_dir) if run_dir else None,
    )

    reports: list[ChaosReport] = []

    async def go() -> int:
        reports.append(await run_chaos(config, out=click.echo))
        return 0

    code = _run(go)
    if not reports:
        sys.exit(code)
    report = reports[0]
    for note in report.notes:
        click.echo(f"note: {note}")
    for violation in report.violations:
        click.echo(str(violation))
    if not report.ok:
        click.echo(f"logs kept in {report.run_dir}")
    if out_path:
        Path(out_path).write_bytes(report_json(report) + b"\n")
    click.echo(report.summary_line())
    sys.exit(0 if report.ok else 1)
