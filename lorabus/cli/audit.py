"""The audit trail: ``lorabus tap`` follows or replays it, ``lorabus audit verify``
checks it, ``lorabus audit timeline`` draws its updates."""

from __future__ import annotations

import asyncio
import datetime
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import click

from lorabus.bus.connect import Bus
from lorabus.bus.options import BusOptions
from lorabus.cli.common import EXIT_FAILED, bus_options, fleet_option, run, subjects_of
from lorabus.schemas import Subjects
from lorabus.schemas.nodes import NODES_ENV, NodeRoster

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient

    from lorabus.audit.timeline_sources import Selection
    from lorabus.audit.verify import TrailRecord

_T = TypeVar("_T")


@click.command()
@bus_options()
@fleet_option
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
    "--out",
    "out_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Append JSON lines to this file instead of printing a timeline.",
)
def tap(
    nats_url: str,
    bus: BusOptions,
    fleet: str,
    follow: bool,
    from_seq: int | None,
    since: datetime.datetime | None,
    out_path: str | None,
) -> None:
    """Follow or replay the fleet's audit trail (commands, acks, events)."""
    from lorabus.audit.tap import Tap
    from lorabus.audit.trail_file import TrailWriter, last_seq_in
    from lorabus.bus.connect import close

    subjects = subjects_of(fleet)
    nodes = _node_roster()

    async def follow_trail() -> int:
        target, name = Bus(nats_url, bus), f"lorabus-tap-{fleet}"
        if follow:  # a tap that follows serves as long as the fleet: it waits for its bus
            nc = await target.wait_connected(name, who=f"tap of fleet {fleet}")
        else:  # a replay is a command: it says at once that NATS is away
            nc = await target.connect(name)
        reader = Tap(
            nc,
            subjects,
            start_seq=from_seq,
            start_time=since,
            after_seq=last_seq_in(out_path) if out_path else 0,
        )
        try:
            with TrailWriter(out_path, echo=click.echo, nodes=nodes) as writer:
                await reader.run(writer.write, follow=follow)
        finally:
            await close(nc)
        return 0

    sys.exit(run(follow_trail))


@click.group()
def audit() -> None:
    """Check an audit trail against lorabus's promises."""


@audit.command("verify")
@click.argument("trail", type=click.Path(exists=True, dir_okay=False), required=False)
@click.option("--live", is_flag=True, help="Check the fleet's audit stream as it is now.")
@bus_options(required=False)
@fleet_option
def audit_verify(
    trail: str | None, live: bool, nats_url: str | None, bus: BusOptions, fleet: str
) -> None:
    """Verify a trail written by 'lorabus tap --out' (or, with --live, the stream).

    Lists each violation with the stream sequences of the records that show it
    (a line of the file that is no record, with its line number); a poison
    record (a payload that is no valid message) and a body that disagrees with
    its subject count as violations. Exits 1 when there is any.
    """
    from lorabus.audit.render import printable
    from lorabus.audit.trail_file import read_trail
    from lorabus.audit.verify import Violation, verify

    _one_source(trail, live, nats_url)
    subjects = subjects_of(fleet)
    nodes = _node_roster()

    async def check() -> int:
        violations: list[Violation] = []
        if trail is not None:
            read = read_trail(trail)
            records = read.records
            violations += [
                Violation(rule="poison_record", message=bad.describe(trail), seqs=[])
                for bad in read.bad_lines
            ]
        else:
            assert nats_url is not None
            records = await _on_stream(Bus(nats_url, bus), subjects, _every_record)
        violations += verify(records, prefix=subjects.prefix, nodes=nodes)
        for violation in violations:
            shown = f" (records {violation.seqs})" if violation.seqs else ""
            click.echo(printable(f"{violation.rule}: {violation.message}{shown}"))
        poison = sum(v.rule == "poison_record" for v in violations)
        click.echo(
            f"audit: {len(records)} records, {len(violations)} violation(s)"
            + (f", {poison} of them poison" if poison else "")
        )
        return EXIT_FAILED if violations else 0

    sys.exit(run(check))


def _node_roster() -> NodeRoster:
    """``$LORABUS_NODES_FILE``'s roster (the auditor's identity sets it), or a
    usage error saying why it cannot be read."""
    try:
        return NodeRoster.from_env()
    except ValueError as exc:
        raise click.UsageError(f"{exc} (${NODES_ENV})") from None


def _one_source(trail: str | None, live: bool, nats_url: str | None) -> None:
    """A TRAIL file or ``--live`` (with a bus to read), not both, not neither."""
    if live == (trail is not None):
        raise click.UsageError("give either a TRAIL file or --live")
    if live and not nats_url:
        raise click.UsageError("--live needs --nats (or $LORABUS_NATS_URL)")


async def _on_stream(
    target: Bus, subjects: Subjects, read: Callable[[NatsClient, Subjects], Awaitable[_T]]
) -> _T:
    """What ``read`` makes of the fleet's audit stream, on a connection of its own."""
    from lorabus.bus.connect import close

    nc = await target.connect(f"lorabus-audit-{subjects.fleet}")
    try:
        return await read(nc, subjects)
    finally:
        await close(nc)


async def _every_record(nc: NatsClient, subjects: Subjects) -> list[TrailRecord]:
    """The fleet's audit stream as it is now."""
    from lorabus.audit.tap import Tap

    records: list[TrailRecord] = []

    async def keep(record: TrailRecord) -> None:
        records.append(record)

    await Tap(nc, subjects).run(keep, follow=False)
    return records


@audit.command("timeline")
@click.argument("trail", type=click.Path(exists=True, dir_okay=False), required=False)
@click.option("--live", is_flag=True, help="Read the fleet's audit stream as it is now.")
@click.option("--update", "update_ids", multiple=True, help="This update (repeatable).")
@click.option(
    "--last",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Without --update: the last K updates of the trail.",
)
@click.option(
    "--sort",
    "order",
    type=click.Choice(["worker", "slowest"]),
    default="worker",
    show_default=True,
    help="Rows by worker id, or the slowest worker (longest phase) first.",
)
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False, writable=True),
    default="timeline.html",
    show_default=True,
    help="Write the page here.",
)
@bus_options(required=False)
@fleet_option
def audit_timeline(
    trail: str | None,
    live: bool,
    update_ids: tuple[str, ...],
    last: int,
    order: str,
    out_path: str,
    nats_url: str | None,
    bus: BusOptions,
    fleet: str,
) -> None:
    """Draw updates from a trail written by 'lorabus tap --out' (or, with --live,
    the stream) as one self-contained HTML page.

    A row per worker with a bar for each phase it went through (fetch, pause,
    load, resume, unload), its engine's pause window behind them and its rank
    offset beside; the coordinator's phases above; the slowest worker and any
    that failed marked. The page needs nothing from the network. Exits 1 when
    the trail holds no update, or not the one asked for.
    """
    from lorabus.audit.timeline_sources import from_file

    _one_source(trail, live, nats_url)
    subjects = subjects_of(fleet)
    _node_roster()  # read again by the timeline: a usage error now, before any work

    async def draw() -> int:
        if trail is not None:
            selection, bad_lines = await asyncio.to_thread(
                from_file, trail, update_ids, last, subjects.prefix
            )
        else:
            assert nats_url is not None
            read = partial(_updates_in_stream, update_ids=update_ids, last=last)
            selection, bad_lines = await _on_stream(Bus(nats_url, bus), subjects, read), 0
        where = trail or f"the audit stream of fleet {fleet}"
        return await _draw(selection, bad_lines, where, order, out_path)

    sys.exit(run(draw))


async def _updates_in_stream(
    nc: NatsClient, subjects: Subjects, *, update_ids: Sequence[str], last: int
) -> Selection:
    """The updates asked for, reading the stream from where they start."""
    from lorabus.audit.tap import StreamReader
    from lorabus.audit.timeline_sources import from_stream

    reader = StreamReader(nc, subjects, who=f"audit timeline of fleet {subjects.fleet}")
    return await from_stream(reader, update_ids, last)


async def _draw(selection: Selection, bad_lines: int, where: str, order: str, out_path: str) -> int:
    """Write the page of ``selection``, or say why there is none; the exit code."""
    from lorabus.audit.render import printable
    from lorabus.audit.timeline_page import render_page

    notes: list[str] = []
    if bad_lines:
        notes.append(f"{bad_lines} line(s) of the trail are no record: left out")
    if selection.poison:
        notes.append(f"{selection.poison} poison record(s) (no valid message): left out")
    if selection.unknown:
        latest = ", ".join(selection.shown[-5:]) or "none"
        click.echo(
            printable(
                f"error: no update {', '.join(selection.unknown)} in {where} "
                f"({len(selection.shown)} update(s); the latest: {latest})"
            ),
            err=True,
        )
        return EXIT_FAILED
    for note in notes:
        click.echo(f"warning: {note}", err=True)
    if not selection.timelines:
        click.echo(printable(f"error: {where} holds no update"), err=True)
        return EXIT_FAILED
    page = render_page(selection.timelines, order=order, notes=notes)
    try:
        await asyncio.to_thread(Path(out_path).write_text, page)
    except OSError as exc:
        click.echo(printable(f"error: cannot write {out_path}: {exc}"), err=True)
        return EXIT_FAILED
    click.echo(printable(f"timeline: {len(selection.timelines)} update(s) drawn in {out_path}"))
    return 0
