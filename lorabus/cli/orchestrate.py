"""What an orchestrator or an operator asks a fleet: ``update``, ``status``, ``schema``."""

from __future__ import annotations

import asyncio
import json
import re
import sys

import click

from lorabus.bus_options import BusOptions
from lorabus.cli.common import EXIT_FAILED, bus_options, fleet_option, run, subjects_of
from lorabus.client import UPDATE_TIMEOUT_S
from lorabus.schemas import UPDATE_ID_PATTERN


def _update_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not re.fullmatch(UPDATE_ID_PATTERN, value):
        raise click.BadParameter(
            f"{value!r}: use 1-128 letters, digits, '_', '.', ':' or '-', "
            "starting with a letter or digit"
        )
    return value


@click.command()
@bus_options()
@fleet_option
@click.option("--adapter", required=True, help="Adapter name (served as <name>-v<version>).")
@click.option("--path", required=True, help="Absolute adapter directory, as workers see it.")
@click.option(
    "--version",
    type=click.IntRange(min=0),
    default=None,
    help="Policy version; default: one past the committed version.",
)
@click.option(
    "--update-id",
    default=None,
    callback=_update_id,
    help="Names the update (default: a new random id). Reuse it with the same adapter, "
    "path and version to fetch an earlier request's result; other content is refused "
    "(bad_request).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=UPDATE_TIMEOUT_S,
    show_default=True,
    help="Seconds to wait for the result.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def update(
    nats_url: str,
    bus: BusOptions,
    fleet: str,
    adapter: str,
    path: str,
    version: int | None,
    update_id: str | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Request an update and wait for its result (exit 0 committed, 1 failed: refused,
    superseded, busy or failed; the error's code and message are printed).
    ``--timeout`` covers connecting too; with ``--json`` every exit prints one
    JSON object, an error's code included."""
    import uuid

    from lorabus.client import CONNECT_TIMEOUT_S, UpdateClient
    from lorabus.errors import LorabusError
    from lorabus.render import result_text
    from lorabus.schemas import FAILED, UpdateResult, to_builtins

    subjects_of(fleet)
    # Chosen here, so that an interrupted wait can say which update to ask about.
    the_id = update_id or uuid.uuid4().hex

    async def request() -> int:
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            async with await UpdateClient.connect(
                nats_url, fleet, options=bus, connect_timeout_s=min(CONNECT_TIMEOUT_S, timeout)
            ) as client:
                left = max(0.1, deadline - asyncio.get_running_loop().time())
                result = await client.update(
                    adapter, path, version=version, update_id=the_id, timeout_s=left
                )
        except LorabusError as exc:
            if not as_json:
                raise
            result = UpdateResult(
                update_id=the_id,
                status=FAILED,
                adapter=adapter,
                version=version,
                error=exc.info(),
            )
        except asyncio.CancelledError:
            click.echo(
                f"interrupted: update {the_id} may still run on the coordinator; its outcome: "
                f"lorabus update --update-id {the_id} --adapter {adapter} --path {path}"
                + (f" --version {version}" if version is not None else ""),
                err=True,
            )
            raise
        click.echo(json.dumps(to_builtins(result)) if as_json else result_text(result))
        return 0 if result.committed else EXIT_FAILED

    sys.exit(run(request))


@click.command()
@bus_options()
@fleet_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON object.")
@click.option("--watch", is_flag=True, help="Redraw the status until Ctrl-C.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds between redraws with --watch.",
)
def status(
    nats_url: str, bus: BusOptions, fleet: str, as_json: bool, watch: bool, interval: float
) -> None:
    """Show members, world sizes, rank offsets, paused state, adapters, the update in flight."""
    from lorabus.client import UpdateClient
    from lorabus.errors import NoCoordinator
    from lorabus.render import status_text
    from lorabus.schemas import to_builtins

    subjects_of(fleet)

    async def ask() -> int:
        async with await UpdateClient.connect(nats_url, fleet, options=bus) as client:
            while True:
                try:
                    fleet_status = await client.status()
                    text = (
                        json.dumps(to_builtins(fleet_status))
                        if as_json
                        else status_text(fleet_status)
                    )
                except NoCoordinator as exc:
                    if not watch:
                        raise
                    text = f"waiting for a coordinator: {exc}"
                if not watch:
                    click.echo(text)
                    return 0
                if not as_json:
                    click.clear()
                click.echo(text)
                await asyncio.sleep(interval)

    sys.exit(run(ask))


@click.command()
def schema() -> None:
    """Print the JSON Schema of every wire message."""
    from lorabus.schemas import json_schema

    click.echo(json.dumps(json_schema(), indent=2))
