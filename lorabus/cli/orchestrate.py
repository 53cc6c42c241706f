"""What an orchestrator or an operator asks a fleet: ``update``, ``result``,
``status`` and ``schema`` (the object store's commands: ``adapters.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from typing import TYPE_CHECKING

import click

from lorabus.bus.options import BusOptions
from lorabus.cli.common import (
    EXIT_FAILED,
    bus_options,
    fleet_option,
    run,
    subjects_of,
    tenant_option,
)
from lorabus.client import UPDATE_TIMEOUT_S
from lorabus.schemas import DIGEST_PATTERN, UPDATE_ID_PATTERN, UpdateMode
from lorabus.schemas.bounds import MAX_KEEP, parse_labels

if TYPE_CHECKING:
    from lorabus.audit.heartbeat_view import HeartbeatListener
    from lorabus.client import UpdateClient
    from lorabus.schemas import UpdateResult

PROGRESS_INTERVAL_S = 1.0
"""How often ``lorabus update`` asks where its update stands (at a terminal)."""


def _update_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not re.fullmatch(UPDATE_ID_PATTERN, value):
        raise click.BadParameter(
            f"{value!r}: use 1-128 letters, digits, '_', '.', ':' or '-', "
            "starting with a letter or digit"
        )
    return value


def _digest(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and value != "auto" and not re.fullmatch(DIGEST_PATTERN, value):
        raise click.BadParameter(f"{value!r}: give 'auto' or 'sha256:' and 64 lowercase hex digits")
    return value


async def _digest_of(path: str) -> str:
    """``--digest auto``: the digest of the directory as this host shows it."""
    from lorabus.adapters.digest import adapter_digest
    from lorabus.errors import BadRequest

    try:
        return await asyncio.to_thread(adapter_digest, path)
    except (OSError, ValueError) as exc:
        raise BadRequest(f"--digest auto cannot hash {path}: {exc}") from exc


@click.command()
@bus_options()
@fleet_option
@tenant_option
@click.option("--adapter", required=True, help="Adapter name (served as <name>-v<version>).")
@click.option(
    "--path",
    default=None,
    help="Absolute adapter directory, as every worker sees it (a shared filesystem). "
    "Without it, the adapter comes from the fleet's object store: --digest names "
    "one pushed before, or --source pushes one first.",
)
@click.option(
    "--source",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="A local adapter directory: pushed to the fleet's object store (once per "
    "content), then fetched by each agent into its node's cache. No shared filesystem.",
)
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
@click.option(
    "--digest",
    default=None,
    callback=_digest,
    help="The adapter's content digest every worker must see at --path: 'auto' computes "
    "it from the directory here, or give 'sha256:<64 hex>'. Default: the workers "
    "must agree among themselves. Without --path: the object store's adapter to load "
    "(lorabus adapter push prints it).",
)
@click.option(
    "--mode",
    type=click.Choice([m.value for m in UpdateMode]),
    default=None,
    help="live: load the new version beside the served one without pausing any "
    "engine; pause: pause the fleet around the load. Default: the coordinator's --mode.",
)
@click.option(
    "--keep",
    type=click.IntRange(min=1, max=MAX_KEEP),
    default=None,
    help="How many of the adapter's newest versions, this one among them, every engine "
    "serves once it commits (async RL with staleness K: K+1); the adapter's other "
    "versions are unloaded. Default: the coordinator's --keep.",
)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=None,
    help="Place the adapter on this many workers only (live mode), chosen by the "
    "coordinator: those that serve it now first, then the least loaded. Default: every "
    "worker --selector matches.",
)
@click.option(
    "--selector",
    "selector",
    multiple=True,
    metavar="KEY=VALUE",
    help="Place the adapter only on workers announcing this label (an agent's --label; "
    "repeatable: every one must match; live mode).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def update(
    nats_url: str,
    bus: BusOptions,
    fleet: str,
    tenant: str | None,
    adapter: str,
    path: str | None,
    source: str | None,
    version: int | None,
    update_id: str | None,
    timeout: float,
    digest: str | None,
    mode: str | None,
    keep: int | None,
    replicas: int | None,
    selector: tuple[str, ...],
    as_json: bool,
) -> None:
    """Request an update and wait for its result (exit 0 committed, 1 failed: refused,
    superseded, busy or failed; the error's code and message are printed).
    ``--timeout`` covers connecting too; with ``--json`` every exit prints one
    JSON object, an error's code included. At a terminal, where the update
    stands (quorum, each phase, who is still awaited) is shown on stderr."""
    import uuid

    from lorabus.audit.render import result_text
    from lorabus.client import CONNECT_TIMEOUT_S, UpdateClient
    from lorabus.errors import LorabusError
    from lorabus.schemas import FAILED, UpdateResult, to_builtins

    subjects_of(fleet)
    digest = _digest_to_send(path, source, digest)
    try:
        labels = parse_labels(selector)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--selector") from None
    # Chosen here, so that an interrupted wait can say which update to ask about.
    the_id = update_id or (f"{tenant}:" if tenant else "") + uuid.uuid4().hex
    # Progress is for a person at a terminal: scripts read stdout (the result)
    # and must not get stderr chatter with it.
    show_progress = not as_json and sys.stdout.isatty()

    async def request() -> int:
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            async with await UpdateClient.connect(
                nats_url,
                fleet,
                options=bus,
                connect_timeout_s=min(CONNECT_TIMEOUT_S, timeout),
                tenant=tenant,
            ) as client:
                left = max(0.1, deadline - asyncio.get_running_loop().time())
                result = await _update_showing_progress(
                    client,
                    show_progress,
                    adapter,
                    path,
                    version=version,
                    update_id=the_id,
                    timeout_s=left,
                    digest=digest,
                    mode=mode,
                    source=source,
                    keep=keep,
                    replicas=replicas,
                    selector=labels,
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
                f"lorabus result {the_id}",
                err=True,
            )
            raise
        click.echo(json.dumps(to_builtins(result)) if as_json else result_text(result))
        return 0 if result.committed else EXIT_FAILED

    sys.exit(run(request))


def _digest_to_send(path: str | None, source: str | None, digest: str | None) -> str | None:
    """``--digest`` as the request carries it ("auto": hashed when sent),
    once ``--path``, ``--source`` and ``--digest`` name one adapter."""
    if path is not None and source is not None:
        raise click.UsageError("give --path or --source, not both")
    if path is None and source is None and digest in (None, "auto"):
        raise click.UsageError(
            "give --path (a shared directory), --source DIR, or --digest sha256:... of an "
            "adapter pushed with lorabus adapter push"
        )
    if source is not None and digest == "auto":
        return None  # the push computes it
    return digest


async def _update_showing_progress(
    client: UpdateClient,
    show_progress: bool,
    adapter: str,
    path: str | None,
    *,
    version: int | None,
    update_id: str,
    timeout_s: float,
    digest: str | None,
    mode: str | None,
    source: str | None,
    keep: int | None,
    replicas: int | None,
    selector: dict[str, str],
) -> UpdateResult:
    """``client.update()``, with where it stands shown on stderr meanwhile
    (if ``show_progress``); ``--digest auto`` is hashed from ``path`` first."""
    progress = asyncio.create_task(_show_progress(client, update_id)) if show_progress else None
    try:
        return await client.update(
            adapter,
            path,
            version=version,
            update_id=update_id,
            timeout_s=timeout_s,
            digest=await _digest_of(path) if digest == "auto" and path else digest,
            mode=mode,
            source=source,
            keep=keep,
            replicas=replicas,
            selector=selector,
        )
    finally:
        if progress is not None:
            progress.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await progress


async def _show_progress(client: UpdateClient, update_id: str) -> None:
    """Print where the update stands on stderr whenever that changes, from the
    fleet's status asked every PROGRESS_INTERVAL_S (until cancelled)."""
    import nats.errors

    from lorabus.audit.render import update_progress_text
    from lorabus.errors import LorabusError

    shown = ""
    while True:
        await asyncio.sleep(PROGRESS_INTERVAL_S)
        try:
            status = await client.status(timeout_s=PROGRESS_INTERVAL_S * 2)
        except (LorabusError, TimeoutError, nats.errors.Error):
            status = None
        line = update_progress_text(update_id, status)
        if line != shown:
            click.echo(line, err=True)
            shown = line


@click.command()
@bus_options()
@fleet_option
@tenant_option
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
    nats_url: str,
    bus: BusOptions,
    fleet: str,
    tenant: str | None,
    as_json: bool,
    watch: bool,
    interval: float,
) -> None:
    """Show members, world sizes, rank offsets, paused state, adapters, the update in flight.

    Each committed adapter gets a line: its served name, version, digest, how
    long ago it was committed, which live members hold it (counted when there
    are many) and the versions kept beside it.

    When no coordinator answers, shows what the agents' heartbeats say instead
    (members, world sizes, paused, ready, adapters), saying so on the first
    line; exit 1 if no heartbeat is heard either. Engines paused outside any
    update, or not ready, get a WARNING line each."""
    from lorabus.audit.heartbeat_view import HeartbeatListener
    from lorabus.audit.render import status_text
    from lorabus.client import UpdateClient
    from lorabus.errors import NoCoordinator
    from lorabus.schemas import to_builtins

    subjects = subjects_of(fleet)

    async def ask() -> int:
        async with await UpdateClient.connect(
            nats_url, fleet, options=bus, tenant=tenant
        ) as client:
            # Opened at the first unanswered request and kept open while watching,
            # so a redraw without a coordinator shows beats heard all along.
            async with contextlib.AsyncExitStack() as listening:
                listener: HeartbeatListener | None = None
                while True:
                    try:
                        fleet_status = await client.status()
                    except NoCoordinator as exc:
                        if tenant:  # a tenant hears no heartbeats: the status is the leader's
                            click.echo(str(exc), err=True)
                            return EXIT_FAILED
                        if listener is None:
                            listener = await listening.enter_async_context(
                                HeartbeatListener(client.nc, subjects)
                            )
                        await listener.wait_window()
                        text, heard = _without_coordinator(listener, str(exc), as_json)
                    else:
                        if listener is not None:
                            await listening.aclose()
                            listener = None
                        heard = True
                        text = (
                            json.dumps(to_builtins(fleet_status))
                            if as_json
                            else status_text(fleet_status)
                        )
                    if not watch:
                        click.echo(text, err=not heard and not as_json)
                        return 0 if heard else EXIT_FAILED
                    if not as_json:
                        click.clear()
                    click.echo(text)
                    await asyncio.sleep(interval)

    sys.exit(run(ask))


def _without_coordinator(
    listener: HeartbeatListener, no_coordinator: str, as_json: bool
) -> tuple[str, bool]:
    """What ``status`` prints when no coordinator answered, and whether any agent
    was heard. The JSON is built here, not as a wire message: it is not one, and
    its ``type`` and ``coordinator_answered`` keep it from passing for a
    ``fleet_status``."""
    from lorabus.audit.render import heartbeat_view_text, member_warnings, printable
    from lorabus.schemas import ErrorCode, to_builtins

    view = listener.view()
    heard = bool(view.members)
    unheard = (
        f"{no_coordinator}, and no agent heartbeat was heard on {view.subject} within "
        f"{view.listened_s:.1f}s (no agents running, another fleet, or this identity may "
        "not subscribe to heartbeats)"
    )
    if as_json:
        shown: dict[str, object] = {
            "type": "heartbeat_view",
            "coordinator_answered": False,
            "fleet": view.fleet,
            "live_world_size": view.live_world_size,
            "members": [to_builtins(m) for m in view.members],
            "listened_s": view.listened_s,
            "ignored_heartbeats": view.ignored,
            "warnings": member_warnings(view.members, update_in_flight=False),
        }
        if not heard:
            shown["error"] = {"code": str(ErrorCode.NO_COORDINATOR), "message": unheard}
        return json.dumps(shown), heard
    return (heartbeat_view_text(view) if heard else f"error: {printable(unheard)}"), heard


@click.command()
def schema() -> None:
    """Print the JSON Schema of every wire message."""
    from lorabus.schemas import json_schema

    click.echo(json.dumps(json_schema(), indent=2))


@click.command()
@bus_options()
@fleet_option
@tenant_option
@click.argument("update_id", callback=_update_id)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def result(
    nats_url: str, bus: BusOptions, fleet: str, tenant: str | None, update_id: str, as_json: bool
) -> None:
    """Show an earlier update's outcome by its id; runs nothing (exit 0 committed,
    1 failed, pending or unknown)."""
    from lorabus.audit.render import result_text
    from lorabus.client import UpdateClient
    from lorabus.schemas import to_builtins

    subjects_of(fleet)

    async def ask() -> int:
        async with await UpdateClient.connect(
            nats_url, fleet, options=bus, tenant=tenant
        ) as client:
            outcome = await client.result(update_id)
        if as_json:
            click.echo(json.dumps(to_builtins(outcome)))
        elif outcome.status in ("pending", "unknown"):
            click.echo(f"update {update_id}: {outcome.status}")
        else:
            click.echo(result_text(outcome))
        return 0 if outcome.committed else EXIT_FAILED

    sys.exit(run(ask))
