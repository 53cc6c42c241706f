"""Development tools that measure: ``lorabus bench`` and ``lorabus chaos``.

Their options default to nothing: what is not given comes from the run's
config (``BenchConfig``'s ``FULL`` or ``QUICK`` profile, ``ChaosConfig``),
which the help texts quote.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from lorabus.cli.common import EXIT_FAILED, INT_LIST, run
from lorabus.cli.extras import require_sim_extra
from lorabus.testbed.bench.config import (
    CONNECTIONS,
    FULL,
    MODES,
    QUICK,
    SERIES,
    TENANT_LAYOUTS,
    TENANT_MODES,
    WindowCase,
)
from lorabus.testbed.chaos.config import ChaosConfig, FleetSettings

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_CHAOS = ChaosConfig()
_C = TypeVar("_C", bound="DataclassInstance")
_R = TypeVar("_R")


def _csv(values: Sequence[object]) -> str:
    return ",".join(map(str, values))


def _names(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _window_case(_ctx: object, _param: object, value: str | None) -> WindowCase | str | None:
    if value is None or value == "off":
        return value
    try:
        n, latency, jitter = value.split(":")
        return WindowCase(int(n), float(latency), float(jitter))
    except ValueError:
        raise click.BadParameter("use N:LATENCY:JITTER, e.g. 256:0.2:0.05, or 'off'") from None


def _window_text(case: WindowCase | None) -> str:
    if case is None:
        return "off"
    return f"{case.n}:{case.load_latency_s:g}:{case.load_jitter_s:g}"


def _with_changes(config: _C, given: Mapping[str, Any], **fixed: Any) -> _C:
    """``config`` with the options ``given`` (None: not given, the config's
    value stays) and ``fixed``; a value the config refuses is a usage error."""
    changes = {name: value for name, value in given.items() if value is not None}
    try:
        return dataclasses.replace(config, **changes, **fixed)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def _report_of(measure: Callable[[], Awaitable[_R]]) -> _R:
    """The report of the run ``measure`` makes; a run that ends without one
    (stopped by a signal, or an error it said) exits with its code."""
    reports: list[_R] = []

    async def go() -> int:
        reports.append(await measure())
        return 0

    code = run(go)
    if not reports:
        sys.exit(code)
    return reports[0]


_DIST = FULL.distribution
_QUICK_DIST = QUICK.distribution
_TENANTS = FULL.tenants
_QUICK_TENANTS = QUICK.tenants
_PLACEMENT = FULL.placement
_QUICK_PLACEMENT = QUICK.placement


@click.command()
@click.option(
    "--quick",
    is_flag=True,
    help="Sizes up to 256, fewer updates, own connections only, no window case; "
    f"the distribution series at N={_csv(_QUICK_DIST.sizes)} with "
    f"{_csv(_QUICK_DIST.adapter_mb)} MB; the tenants series at N={_csv(_QUICK_TENANTS.sizes)} "
    f"with T={_csv(_QUICK_TENANTS.tenants)}; the placement series at "
    f"N={_csv(_QUICK_PLACEMENT.sizes)} with T={_QUICK_PLACEMENT.tenants}.",
)
@click.option(
    "--series",
    help=f"Which of {', '.join(SERIES)} to run: the update modes size by size, "
    "an adapter of S MB to N agents over the bus beside path mode and an HTTP pull, "
    "T tenants each updating its own adapter in a loop, and/or T tenants' adapters "
    "placed on engines that cannot hold them all "
    f"[default: {_csv(FULL.series)}; placement with --capacity].",
)
@click.option(
    "--sizes",
    type=INT_LIST,
    help=f"Fleet sizes [default: {_csv(FULL.sizes)}; quick {_csv(QUICK.sizes)}].",
)
@click.option(
    "--updates",
    type=click.IntRange(min=1),
    help=f"Timed updates per size and mode [default: {FULL.updates}; quick {QUICK.updates}].",
)
@click.option(
    "--world-sizes",
    type=INT_LIST,
    help=f"World sizes, cycled over the workers [default: {_csv(FULL.world_sizes)}].",
)
@click.option(
    "--load-latency",
    type=click.FloatRange(min=0),
    help=f"Seconds each simulated load takes [default: {FULL.load_latency_s:g}].",
)
@click.option(
    "--load-jitter",
    type=click.FloatRange(min=0),
    help="Each load takes latency +- up to this, drawn per worker and update "
    f"[default: {FULL.load_jitter_s:g}].",
)
@click.option(
    "--window-case",
    callback=_window_case,
    help="Also run N with realistic loads, N:LATENCY:JITTER, or 'off' "
    f"[default: {_window_text(FULL.window_case)}; quick: {_window_text(QUICK.window_case)}].",
)
@click.option("--modes", help=f"Which of {', '.join(MODES)} to run [default: {_csv(FULL.modes)}].")
@click.option(
    "--connections",
    help=f"Agents' NATS connections for floor and null: {' or '.join(CONNECTIONS)} "
    f"[default: {_csv(FULL.connections)}; quick: {_csv(QUICK.connections)}].",
)
@click.option(
    "--http-connections",
    help=f"Agents' NATS connections for http and live: {' or '.join(CONNECTIONS)} "
    f"[default: {_csv(FULL.http_connections)}].",
)
@click.option(
    "--agent-procs",
    type=click.IntRange(min=1, max=64),
    help=f"Processes the agents are spread over [default: {FULL.agent_procs}].",
)
@click.option(
    "--sim-workers",
    type=click.IntRange(min=1),
    help=f"Simulated workers per simulated fleet process [default: {FULL.sim_workers}].",
)
@click.option(
    "--heartbeat-s",
    type=click.FloatRange(min=0.05),
    help="Agents' heartbeat interval [default: max(1, N/128)].",
)
@click.option(
    "--keep",
    type=click.IntRange(min=1),
    help="The coordinator's --keep [default: every version of the run, as the "
    "baseline unloads nothing; 2 measures retiring too].",
)
@click.option(
    "--secure",
    is_flag=True,
    help="NATS with lorabus auth init's configuration (nkeys, per-role permissions, "
    "mutual TLS), every process as its own identity; own or node connections.",
)
@click.option(
    "--no-canary",
    is_flag=True,
    help="The coordinators run no canary phase (its cost: the same run without it).",
)
@click.option(
    "--dist-sizes",
    type=INT_LIST,
    help="Distribution series: fleet sizes "
    f"[default: {_csv(_DIST.sizes)}; quick {_csv(_QUICK_DIST.sizes)}].",
)
@click.option(
    "--adapter-mb",
    type=INT_LIST,
    help="Distribution series: adapter sizes in MB "
    f"[default: {_csv(_DIST.adapter_mb)}; quick {_csv(_QUICK_DIST.adapter_mb)}].",
)
@click.option(
    "--agents-per-node",
    type=click.IntRange(min=1),
    help="Distribution series: agents sharing one node's cache directory "
    f"[default: {_DIST.agents_per_node}].",
)
@click.option(
    "--dist-updates",
    type=click.IntRange(min=1),
    help="Distribution series: timed updates per size, adapter size and way "
    f"[default: {_DIST.updates}].",
)
@click.option(
    "--tenants",
    type=INT_LIST,
    help="Tenants series: how many tenants (T) update at once "
    f"[default: {_csv(_TENANTS.tenants)}; quick {_csv(_QUICK_TENANTS.tenants)}].",
)
@click.option(
    "--tenant-sizes",
    type=INT_LIST,
    help="Tenants series: fleet sizes "
    f"[default: {_csv(_TENANTS.sizes)}; quick {_csv(_QUICK_TENANTS.sizes)}].",
)
@click.option(
    "--tenant-modes",
    help=f"Tenants series: which of {', '.join(TENANT_MODES)} the coordinator runs "
    f"[default: {_csv(_TENANTS.modes)}].",
)
@click.option(
    "--tenant-seconds",
    type=click.FloatRange(min=0, min_open=True),
    help="Tenants series: the timed window of each case "
    f"[default: {_TENANTS.seconds:g}; quick {_QUICK_TENANTS.seconds:g}].",
)
@click.option(
    "--tenant-connections",
    type=click.Choice(TENANT_LAYOUTS),
    help="Tenants series: the agents' NATS connections, own (one per agent) or node "
    f"(one per node agent of 8 workers) [default: {_TENANTS.layout}].",
)
@click.option(
    "--capacity",
    type=click.IntRange(min=2),
    help="Placement series (run by default when this is given): the adapters each "
    f"engine holds at once (C) [default: {_PLACEMENT.capacity}]; with --tenants T (the "
    f"first value) [default: {_PLACEMENT.tenants}; quick {_QUICK_PLACEMENT.tenants}], "
    f"--tenant-sizes [default: {_csv(_PLACEMENT.sizes)}; quick "
    f"{_csv(_QUICK_PLACEMENT.sizes)}] and --keep K [default: {_PLACEMENT.keep}].",
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
    series: str | None,
    sizes: list[int] | None,
    updates: int | None,
    world_sizes: list[int] | None,
    load_latency: float | None,
    load_jitter: float | None,
    window_case: WindowCase | str | None,
    modes: str | None,
    connections: str | None,
    http_connections: str | None,
    agent_procs: int | None,
    sim_workers: int | None,
    heartbeat_s: float | None,
    keep: int | None,
    secure: bool,
    no_canary: bool,
    dist_sizes: list[int] | None,
    adapter_mb: list[int] | None,
    agents_per_node: int | None,
    dist_updates: int | None,
    tenants: list[int] | None,
    tenant_sizes: list[int] | None,
    tenant_modes: str | None,
    tenant_seconds: float | None,
    tenant_connections: str | None,
    capacity: int | None,
    out_path: str | None,
    run_dir: str | None,
) -> None:
    """Measure updates: lorabus (null and HTTP engines), direct HTTP, and the bare bus;
    with --series distribution, adapters over the bus beside path mode and an HTTP pull;
    with --series tenants, many tenants updating their own adapters at once; with
    --capacity, more tenants' adapters than engines hold, placed on some workers each."""
    require_sim_extra()
    from lorabus.testbed.bench import report_json, table
    from lorabus.testbed.bench.runner import run_bench

    profile = QUICK if quick else FULL
    distribution = _with_changes(
        profile.distribution,
        {
            "sizes": tuple(dist_sizes) if dist_sizes else None,
            "adapter_mb": tuple(adapter_mb) if adapter_mb else None,
            "agents_per_node": agents_per_node,
            "updates": dist_updates,
        },
    )
    tenants_case = _with_changes(
        profile.tenants,
        {
            "tenants": tuple(tenants) if tenants else None,
            "sizes": tuple(tenant_sizes) if tenant_sizes else None,
            "modes": _names(tenant_modes),
            "seconds": tenant_seconds,
            "layout": tenant_connections,
        },
    )
    placement = _with_changes(
        profile.placement,
        {
            "capacity": capacity,
            "tenants": tenants[0] if tenants else None,
            "sizes": tuple(tenant_sizes) if tenant_sizes else None,
            "keep": keep,
        },
    )
    if capacity is not None and series is None:
        series = "placement"
    window: dict[str, Any] = {}
    if window_case is not None:  # "off" turns the profile's window case off
        window["window_case"] = None if window_case == "off" else window_case
    config = _with_changes(
        profile,
        {
            "sizes": tuple(sizes) if sizes else None,
            "updates": updates,
            "world_sizes": tuple(world_sizes) if world_sizes else None,
            "load_latency_s": load_latency,
            "load_jitter_s": load_jitter,
            "series": _names(series),
            "modes": _names(modes),
            "connections": _names(connections) or (("own",) if secure else None),
            "http_connections": _names(http_connections),
            "secure": secure or None,
            "canary": False if no_canary else None,
            "agent_procs": agent_procs,
            "sim_workers": sim_workers,
            "heartbeat_s": heartbeat_s,
            "keep": keep,
            "run_dir": Path(run_dir) if run_dir else None,
        },
        distribution=distribution,
        tenants=tenants_case,
        placement=placement,
        **window,
    )
    report = _report_of(lambda: run_bench(config, out=lambda line: click.echo(line, err=True)))
    for line in table(report):
        click.echo(line)
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_bytes(report_json(report) + b"\n")
    sys.exit(EXIT_FAILED if report.unmeasured else 0)


@click.command()
@click.option(
    "--duration",
    type=click.FloatRange(min=1),
    help=f"Seconds of updates under faults, then every fault is healed and checked "
    f"[default: {_CHAOS.duration_s:g}].",
)
@click.option(
    "--faults",
    type=click.IntRange(min=1),
    help="Instead of --duration: run until this many faults have been injected "
    "(about N x --fault-gap seconds).",
)
@click.option("--seed", type=int, help=f"Seeds the fault schedule [default: {_CHAOS.seed}].")
@click.option(
    "--workers",
    type=click.IntRange(min=1, max=64),
    help=f"Simulated workers [default: {len(_CHAOS.world_sizes)}].",
)
@click.option(
    "--world-sizes",
    type=INT_LIST,
    help=f"World sizes, cycled over the workers [default: {_csv(_CHAOS.world_sizes)}].",
)
@click.option(
    "--fault-gap",
    type=click.FloatRange(min=0.1),
    help="Mean seconds between the starts of two faults (one fault per target at a time) "
    f"[default: {_CHAOS.mean_gap_s:g}].",
)
@click.option(
    "--nats-cluster",
    is_flag=True,
    help="Run on a 3-node nats-server cluster (streams with 3 replicas) and add node "
    "partitions to the faults: one node's routes to the others cut both ways.",
)
@click.option(
    "--workers-per-node",
    type=click.IntRange(min=1, max=64),
    default=1,
    show_default=True,
    help="Run the workers under node agents (lorabus agent --node-file) of this many "
    "workers each: an agent kill, stop or partition then takes a whole node's workers.",
)
@click.option(
    "--adapters",
    type=click.Choice(["bus", "path"]),
    help="How updates name adapters: pushed to the fleet's object store and asked for by "
    f"digest (bus), or a directory every agent reads (path) [default: {_CHAOS.adapters}].",
)
@click.option(
    "--tenants",
    type=click.IntRange(min=1),
    help="Trainers updating at once (at most 16), each its own loop on its own adapter "
    f"(tenant-0, ...; with 1, adapter policy) [default: {_CHAOS.tenants}].",
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
    duration: float | None,
    faults: int | None,
    seed: int | None,
    workers: int | None,
    world_sizes: list[int] | None,
    fault_gap: float | None,
    nats_cluster: bool,
    workers_per_node: int,
    adapters: str | None,
    tenants: int | None,
    out_path: str | None,
    run_dir: str | None,
) -> None:
    """Run updates while a seeded schedule kills, stops and slows the fleet; check invariants."""
    require_sim_extra()
    from lorabus.testbed.chaos import report_json
    from lorabus.testbed.chaos.runner import run_chaos

    if duration is not None and faults is not None:
        raise click.UsageError(
            "give --duration or --faults, not both: with --faults the run lasts until "
            "that many faults have been injected"
        )
    if logging.getLogger().level > logging.INFO:
        # Its own connection's warnings while the nats-server restarts on purpose.
        logging.getLogger("lorabus.bus.connect").setLevel(logging.ERROR)
    sizes = world_sizes or list(_CHAOS.world_sizes)
    world_sizes = [sizes[i % len(sizes)] for i in range(workers or len(sizes))]
    config = _with_changes(
        _CHAOS,
        {
            "duration_s": duration,
            "faults": faults,
            "seed": seed,
            "mean_gap_s": fault_gap,
            "adapters": adapters,
            "tenants": tenants,
            "run_dir": Path(run_dir) if run_dir else None,
        },
        world_sizes=world_sizes,
        fleet=(
            FleetSettings(
                world_sizes,
                nats_nodes=3 if nats_cluster else 1,
                workers_per_node=workers_per_node,
            )
            if nats_cluster or workers_per_node > 1
            else None
        ),
    )
    report = _report_of(lambda: run_chaos(config, out=click.echo))
    for violation in report.violations:
        click.echo(str(violation))
    if not report.ok:
        click.echo(f"logs kept in {report.run_dir}")
    if out_path:
        Path(out_path).write_bytes(report_json(report) + b"\n")
    for line in report.figure_lines():
        click.echo(line)
    click.echo(report.summary_line())
    sys.exit(0 if report.ok else EXIT_FAILED)
