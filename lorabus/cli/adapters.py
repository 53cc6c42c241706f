"""The fleet's object store of adapters: ``adapter push`` and ``adapter list``."""

from __future__ import annotations

import json
import sys
import time

import click

from lorabus.bus.options import BusOptions
from lorabus.cli.common import bus_options, fleet_option, run, subjects_of, tenant_option
from lorabus.client import PUSH_TIMEOUT_S
from lorabus.schemas.tenants import TENANTS_ENV


@click.group()
def adapter() -> None:
    """Adapters in the fleet's object store (no shared filesystem needed)."""


@adapter.command("push")
@bus_options()
@fleet_option
@tenant_option
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=PUSH_TIMEOUT_S,
    show_default=True,
    help="Seconds the upload may take.",
)
def push(
    nats_url: str, bus: BusOptions, fleet: str, tenant: str | None, directory: str, timeout: float
) -> None:
    """Store the adapter in DIRECTORY in the fleet's object store (a tenant's:
    its own), keyed by its content digest, and print that digest (content
    already stored is not sent again). Then: lorabus update --adapter NAME
    --digest DIGEST (as the same tenant)."""
    from lorabus.client import UpdateClient

    subjects_of(fleet)

    async def push_() -> int:
        async with await UpdateClient.connect(
            nats_url, fleet, options=bus, tenant=tenant
        ) as client:
            click.echo(await client.push_adapter(directory, timeout_s=timeout))
        return 0

    sys.exit(run(push_))


@adapter.command("list")
@bus_options()
@fleet_option
@click.option(
    "--tenants",
    "tenants_file",
    default="",
    envvar=TENANTS_ENV,
    help="The fleet's tenants file: list each tenant's store too (as <tenant>/<digest>).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the listing as one JSON object.")
def list_adapters(
    nats_url: str, bus: BusOptions, fleet: str, tenants_file: str, as_json: bool
) -> None:
    """Every object of the fleet's adapter store (and of each tenant's), with
    its size, its age and what keeps it (as an identity that may read the
    state bucket too, such as the operator's); the leader deletes one nothing
    keeps once it is older than its --orphan-after. Also the leftovers of
    pushes that stopped."""
    from lorabus.adapters.store import store_contents
    from lorabus.audit.render import age_text
    from lorabus.bus.connect import Bus, close
    from lorabus.coordinator.adapter_store import kept_by_records, listing
    from lorabus.coordinator.signals import StoreUnavailable
    from lorabus.coordinator.store import FleetStore
    from lorabus.coordinator.tenants import Tenants

    subjects = subjects_of(fleet)
    try:
        stores = ["", *sorted(Tenants.load(tenants_file).by_name)]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--tenants") from None

    async def list_() -> int:
        nc = await Bus(nats_url, bus).connect(f"lorabus-adapter-list-{fleet}")
        try:
            every = {s: await store_contents(nc, subjects.for_store(s)) for s in stores}
            try:
                kept = await kept_by_records(await FleetStore.bind(nc, subjects))
            except StoreUnavailable as exc:
                kept = None
                click.echo(f"what keeps each object is not known: {exc}", err=True)
        finally:
            await close(nc)
        listed = listing(every, kept or {})
        metas = sorted(m for c in every.values() for m in c.stray_metas)
        stopped = sorted(
            f"{s + '/' if s else ''}{k}" for s, c in every.items() for k in c.stray_chunks
        )
        if as_json:
            leftovers = {"stray_metas": metas, "stopped_pushes": stopped}
            click.echo(json.dumps({"objects": [vars(o) for o in listed], **leftovers}))
            return 0
        now = time.time()
        for item in listed:
            why = "; ".join(item.kept_by) or ("nothing keeps it" if kept is not None else "")
            age = "" if item.stored_at is None else f"stored {age_text(now - item.stored_at)} ago"
            click.echo(f"{item.digest}  {item.size / 1e6:9.1f} MB  {age:<18} {why}".rstrip())
        click.echo(
            f"{len(listed)} object(s), {sum(o.size for o in listed) / 1e6:.1f} MB; leftovers: "
            f"{len(stopped)} stopped push(es), {len(metas)} meta record(s) of no pushed adapter"
        )
        return 0

    sys.exit(run(list_))
