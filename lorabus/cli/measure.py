"""Development tools that measure: ``lorabus bench`` and ``lorabus chaos``."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from lorabus.cli.common import EXIT_FAILED, INT_LIST, run
from lorabus.cli.extras import require_sim_extra


def _window_case(_ctx: object, _param: object, value: str | None) -> str | None:
    if value is None or value == "off":
        return value
    try:
        n, latency, jitter = value.split(":")
        int(n), float(latency), float(jitter)
    except ValueError:
        raise click.BadParameter("use N:LATENCY:JITTER, e.g. 256:0.2:0.05, or 'off'") from None
    return value


@click.command()
@click.option(
    "--quick",
    is_flag=True,
    help="Sizes up to 256, fewer updates, own connections only, no window case.",
)
@click.option(
    "--sizes", type=INT_LIST, help="Fleet sizes [default: 8,64,256,1024; quick 8,64,256]."
)
@click.option(
    "--updates",
    type=click.IntRange(min=1),
    default=None,
    help="Timed updates per size and mode [default: 20; quick 5].",
)
@click.option(
    "--world-sizes",
    type=INT_LIST,
    default="2,4,1,1",
    show_default=True,
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
    require_sim_extra()
    from lorabus.testbed.bench import BenchConfig, BenchReport, WindowCase, report_json, run_bench
    from lorabus.testbed.bench import table as bench_table
    from lorabus.testbed.bench.config import FULL_SIZES, QUICK_SIZES

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

    code = run(go)
    if not reports:
        sys.exit(code)
    report = reports[0]
    for line in bench_table(report):
        click.echo(line)
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_bytes(report_json(report) + b"\n")
    sys.exit(EXIT_FAILED if report.unmeasured else 0)


@click.command()
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
    type=INT_LIST,
    default="2,1,4,1",
    show_default=True,
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
    require_sim_extra()
    from lorabus.testbed.chaos import ChaosConfig, ChaosReport, report_json, run_chaos

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

    code = run(go)
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
    sys.exit(0 if report.ok else EXIT_FAILED)
