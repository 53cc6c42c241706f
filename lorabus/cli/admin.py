"""The operator's commands: ``lorabus auth init`` (identities and the server's
configuration), ``lorabus provision`` (the KV buckets, the adapter store and
the audit stream)
and ``lorabus reset`` (an adapter's committed state)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from lorabus.bus.connect import Bus
from lorabus.bus.options import BusOptions
from lorabus.cli.common import bus_options, fleet_option, run, subjects_of
from lorabus.coordinator.config import StorageConfig
from lorabus.operator import RESET_TIMEOUT_S
from lorabus.service_flags import COORDINATOR_FLAGS, build_config, config_options

STORAGE_FLAGS = tuple(f for f in COORDINATOR_FLAGS if f.field in StorageConfig.__struct_fields__)


class NameList(click.ParamType):
    """Names separated by commas, e.g. ``w000,w001``."""

    name = "NAME,NAME,..."

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> list[str]:
        if isinstance(value, list):
            return value
        names = [part.strip() for part in str(value).split(",") if part.strip()]
        if not names:
            self.fail("give one or more names separated by commas, e.g. w000,w001")
        return names


@click.group()
def auth() -> None:
    """A fleet's NATS identities: one per role and per worker."""


@auth.command("init")
@fleet_option
@click.option(
    "--workers",
    "worker_ids",
    type=NameList(),
    default=None,
    help="The worker ids of lone agents (an identity each), e.g. w000,w001.",
)
@click.option(
    "--node",
    "node_specs",
    multiple=True,
    metavar="NAME=W1,W2,...",
    help="A node agent and the workers it drives (repeatable): one identity for them "
    "all, whose acks and beats the coordinator takes only for those workers.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    required=True,
    help="A new (or empty) directory for the configuration and the identities.",
)
@click.option("--tls/--no-tls", default=True, show_default=True, help="Also a CA and certificates.")
@click.option(
    "--host",
    "hosts",
    multiple=True,
    default=("localhost", "127.0.0.1"),
    show_default=True,
    help="A name or address clients reach the server at (repeatable; for its certificate).",
)
@click.option(
    "--method",
    type=click.Choice(["nkey", "cert", "jwt"]),
    default="nkey",
    show_default=True,
    help="How identities prove themselves: an nkey seed each, a client certificate each, "
    "or a .creds file each of an operator's accounts (JWTs; the server trusts the operator).",
)
@click.option(
    "--cluster-node",
    "cluster_nodes",
    multiple=True,
    metavar="HOST[:PORT]",
    help="A node of a NATS cluster, where its routes listen (repeatable; port 6222 by "
    "default): writes route credentials and route TLS that every node must present.",
)
@click.option(
    "--jetstream-max-bytes",
    type=click.IntRange(min=1),
    default=None,
    help="The fleet account's JetStream file storage, in bytes. Default: 16 GiB (the "
    "adapter store's 10 GiB, the audit stream's 1 GiB, 5 GiB only the KV buckets use), "
    "times the cluster's nodes (JetStream counts every replica).",
)
@click.option(
    "--tenant",
    "tenant_specs",
    multiple=True,
    metavar="NAME=PATTERN",
    help="A tenant of the fleet (repeatable): an identity that may push adapters and "
    "update, and see the results and status of, only the adapters whose names match "
    "PATTERN (shell-style, e.g. 'team-a-*'), within quotas the coordinator's "
    "tenants.json sets.",
)
def auth_init(
    fleet: str,
    worker_ids: list[str] | None,
    out_dir: str,
    tls: bool,
    hosts: tuple[str, ...],
    method: str,
    cluster_nodes: tuple[str, ...],
    jetstream_max_bytes: int | None,
    tenant_specs: tuple[str, ...],
    node_specs: tuple[str, ...],
) -> None:
    """Write a nats-server configuration that gives each role exactly its
    permissions, and one identity (a folder, 0700) per role, per worker (or
    node) and per tenant."""
    from lorabus.schemas.tenants import parse_tenant
    from lorabus.security.auth_init import SERVER_CONF, write_fleet_auth

    subjects = subjects_of(fleet)
    worker_ids = worker_ids or []
    try:
        tenants = dict(parse_tenant(spec) for spec in tenant_specs)
        if len(tenants) != len(tenant_specs):
            raise ValueError("each --tenant must name a different tenant")
        nodes = dict(_node_spec(spec) for spec in node_specs)
        if len(nodes) != len(node_specs):
            raise ValueError("each --node must name a different node")
        written = write_fleet_auth(
            Path(out_dir),
            subjects,
            worker_ids,
            tls=tls,
            hosts=hosts,
            method=method,
            cluster_nodes=cluster_nodes,
            jetstream_max_bytes=jetstream_max_bytes,
            tenants=tenants,
            nodes=nodes,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(f"wrote the identities of fleet {fleet!r} to {written.directory}:")
    for name in written.identities:
        click.echo(f"  {name:<16} {written.identities[name].folder}")
    scheme = "tls" if tls else "nats"
    click.echo("start the server with it, for example:")
    click.echo(f"  nats-server -c {written.directory / SERVER_CONF} -js -sd /var/lib/nats -p 4222")
    click.echo("then set the fleet up once, as its operator:")
    click.echo(
        f"  lorabus --identity {written.directory / 'operator'} provision "
        f"--nats {scheme}://localhost:4222 --fleet {fleet}"
    )
    click.echo("and run every lorabus process as its own identity, for example:")
    if worker_ids:
        click.echo(
            f"  lorabus --identity {written.directory / ('agent-' + worker_ids[0])} agent "
            f"--nats {scheme}://localhost:4222 --fleet {fleet} --worker-id {worker_ids[0]} ..."
        )
    for node in list(nodes)[:1]:
        click.echo(
            f"  lorabus --identity {written.directory / ('node-' + node)} agent "
            f"--nats {scheme}://localhost:4222 --fleet {fleet} --node-file {node}.toml"
        )
    if tenants:
        first = next(iter(tenants))
        click.echo("a tenant updates its own adapters as its own identity, for example:")
        click.echo(
            f"  lorabus --identity {written.directory / ('tenant-' + first)} update "
            f"--nats {scheme}://localhost:4222 --fleet {fleet} --adapter NAME --source DIR"
        )


def _node_spec(spec: str) -> tuple[str, list[str]]:
    """``NAME=W1,W2`` as the node's name and its workers."""
    name, sep, workers = spec.partition("=")
    listed = [w.strip() for w in workers.split(",") if w.strip()]
    if not sep or not name or not listed:
        raise ValueError(f"--node {spec!r} is not NAME=W1,W2,...")
    return name, listed


@click.command()
@bus_options()
@fleet_option
@config_options(StorageConfig, STORAGE_FLAGS)
def provision(nats_url: str, bus: BusOptions, fleet: str, **settings: Any) -> None:
    """Create the fleet's KV buckets and audit stream (which refuses delete and
    purge); run once, as the fleet's operator. Where they exist with other
    settings, only an identity that may change a stream's configuration (a
    server without roles) brings them to these."""
    from lorabus.bus.connect import close
    from lorabus.coordinator.streams import StreamChangeRefused, StreamNotMade
    from lorabus.coordinator.streams import provision as set_up

    config = build_config(StorageConfig, STORAGE_FLAGS, settings, fleet=fleet)

    async def go() -> int:
        nc = await Bus(nats_url, bus).connect(f"lorabus-operator-{fleet}")
        try:
            changed = await set_up(nc, config)
        except (StreamChangeRefused, StreamNotMade) as exc:
            click.echo(f"error: {exc}", err=True)
            return 1
        finally:
            await close(nc)
        for name in changed:
            click.echo(f"stream {name}: brought to these settings")
        click.echo(f"fleet {fleet!r}: KV buckets and audit stream ready")
        return 0

    sys.exit(run(go))


@click.command()
@bus_options()
@fleet_option
@click.option("--adapter", required=True, help="The adapter whose committed state to forget.")
@click.option("--reason", required=True, help="Why, for the audit trail (for example a ticket id).")
@click.option(
    "--expected-version",
    type=click.IntRange(min=0),
    default=None,
    help="Reset only if this version is the committed one.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=0.1),
    default=RESET_TIMEOUT_S,
    show_default=True,
    help="Seconds to wait for the answer (a reset waits for the update running).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def reset(
    nats_url: str,
    bus: BusOptions,
    fleet: str,
    adapter: str,
    reason: str,
    expected_version: int | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Forget what is committed for an adapter, so that any version may come
    next (after a bogus version was committed). Engines keep serving what
    they hold; the next update starts a new lineage of served names. Run as
    the fleet's operator; recorded in the trail as committed_reset."""
    import json

    from lorabus.audit.render import printable
    from lorabus.bus.connect import close
    from lorabus.operator import reset_committed
    from lorabus.schemas import to_builtins

    subjects = subjects_of(fleet)

    async def go() -> int:
        nc = await Bus(nats_url, bus).connect(f"lorabus-operator-{fleet}")
        try:
            result = await reset_committed(
                nc,
                subjects,
                adapter,
                reason,
                expected_version=expected_version,
                timeout_s=timeout_s,
            )
        finally:
            await close(nc)
        if as_json:
            click.echo(json.dumps(to_builtins(result)))
        elif result.ok:
            click.echo(
                f"reset {printable(adapter)}: version {result.previous_version} from "
                f"{printable(result.previous_path)} is no longer committed; the next "
                f"update starts lineage {result.lineage}"
            )
        else:
            error = result.error
            click.echo(
                f"error: {error.code}: {printable(error.message)}" if error else "error",
                err=True,
            )
        return 0 if result.ok else 1

    sys.exit(run(go))
