"""``lorabus auth init``: a fleet's identities and the server configuration that pins them.

For a fleet and its worker ids this writes, into one new directory:

- ``nats-server.conf``: the fleet's accounts (:mod:`lorabus.security.accounts`: the
  coordinators beside the fleet's streams, every other identity in an
  account of its own that imports what it needs), one user per identity
  (coordinator, orchestrator, auditor, operator, one agent per worker), each
  with exactly its role's permissions (:mod:`lorabus.security.roles`); with TLS, the
  server's certificate, and client certificates required;
- per identity, a folder (mode 0700) with its secret (mode 0600) and
  ``lorabus.env``, the ``LORABUS_*`` variables that make a ``lorabus``
  process connect as that identity;
- per node agent (``--node NAME=w000,w001``), an identity ``node-NAME``
  that acks and beats for those workers on its node's subjects, and in the
  coordinator's folder ``nodes.json``, which workers each node speaks for
  (always written: with no nodes, the coordinator takes no node's message);
- per tenant (``--tenant NAME=PATTERN``), an identity ``tenant-NAME`` that
  asks on its own subjects, and in the coordinator's folder ``tenants.json``,
  each tenant's adapter pattern and quotas (edit it to change the quotas),
  which the coordinator's ``lorabus.env`` names;
- with TLS, a CA (``ca.pem``; its key stays beside it, 0600), the server's
  certificate for the given host names, and a client certificate per identity;
- for a cluster (``cluster_nodes``), the ``cluster`` block every node shares:
  a route user with a random password, route TLS with a certificate of the
  fleet's CA that every route must present (``verify``), and the routes
  between the nodes. A server that is not given both cannot join: client
  permissions, nkeys and client TLS mean nothing to a route.

Users authenticate with nkeys: each identity's seed stays in its own file,
and the server knows only the public keys. This is nkey authentication in the
server's configuration, not the decentralized JWT scheme: a fleet's
identities are known when it is set up, and adding a worker means running
this again (or adding one user) and reloading the server. Where NATS is run
with operator-managed accounts, create the users there with the same
permissions and give lorabus their ``.creds`` files instead (``--creds``).
With ``cert`` authentication there are no seeds: the server maps each client
certificate's subject to its user (``verify_and_map``).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lorabus.bus.options import ENV, ENV_FILE, inbox_prefix_for, public_key_of
from lorabus.schemas import Subjects, check_token
from lorabus.schemas.nodes import NODE_ENV, NODES_ENV, check_nodes, encode_nodes
from lorabus.schemas.tenants import TENANT_ENV, TENANTS_ENV, Tenant, encode_tenants
from lorabus.security.accounts import Account, FleetAccounts, fleet_accounts, js_api_prefix
from lorabus.security.auth_jwt import JwtAuthority
from lorabus.security.certificates import CertificateAuthority, write_secret
from lorabus.security.roles import Permissions, Role, identity_name, permissions
from lorabus.security.signing import COORDINATOR_KEYS_ENV, SIGNING_KEY_ENV, new_signing_seed

SERVER_CONF = "nats-server.conf"
SEED_FILE = "nkey.seed"
CREDS_FILE = "user.creds"
JWT_SEEDS = "jwt-keys"
"""With ``--method jwt``: the operator's and the accounts' seeds, to sign more."""
NODES_FILE = "nodes.json"
"""In the coordinator's folder: which workers each node agent speaks for."""
TENANTS_FILE = "tenants.json"
"""In the coordinator's folder: the fleet's tenants (coordinator/tenants.py)."""
SIGNING_SEED_FILE = "command-signing.seed"
"""In the coordinator's folder: the key its commands are signed with. Every
coordinator of the fleet (run two or more for failover) uses this one key."""
CLUSTER_PORT = 6222
ROUTE_USER = "route"


@dataclass(frozen=True)
class Identity:
    name: str
    role: Role
    worker_id: str | None
    folder: Path
    inbox_prefix: str

    @property
    def env_file(self) -> Path:
        return self.folder / ENV_FILE


@dataclass(frozen=True)
class FleetAuth:
    """What ``write_fleet_auth`` wrote."""

    directory: Path
    server_conf: Path
    identities: dict[str, Identity]
    ca_file: Path | None
    signing_key: str = ""
    """The public key the fleet's coordinators sign commands with."""

    def identity(self, role: Role, worker_id: str | None = None) -> Identity:
        return self.identities[identity_name(role, worker_id)]


JETSTREAM_BYTES_PER_REPLICA = 16 << 30
"""The fleet account's JetStream file storage, per replica of its streams:
room for the adapter store's default limit (10 GiB) and the audit stream's
(1 GiB), which they never outgrow, and 5 GiB that only the KV buckets (the
leader's lease, the commit points, the results) use, so that a full store
never blocks a lease renewal or a commit. The server reserves each stream's
limit when it is made, and refuses one the budget cannot hold. Each
tenant's adapter store adds its ``max_bytes`` (:func:`default_jetstream_bytes`)."""
MIN_JETSTREAM_BYTES = 64 << 20


def default_jetstream_bytes(
    cluster_nodes: Sequence[str] = (), tenants: Mapping[str, Tenant] | None = None
) -> int:
    """The fleet account's JetStream storage: the budget above and each
    tenant's store; JetStream counts every replica of a stream against it,
    so on a cluster it is that times the nodes."""
    own = sum(tenant.max_bytes for tenant in (tenants or {}).values())
    return (JETSTREAM_BYTES_PER_REPLICA + own) * max(1, len(cluster_nodes))


def write_fleet_auth(
    directory: Path,
    subjects: Subjects,
    worker_ids: Sequence[str],
    *,
    tls: bool = False,
    hosts: Sequence[str] = ("localhost", "127.0.0.1"),
    method: str = "nkey",
    cluster_nodes: Sequence[str] = (),
    jetstream_max_bytes: int | None = None,
    tenants: Mapping[str, Tenant] | None = None,
    nodes: Mapping[str, Sequence[str]] | None = None,
) -> FleetAuth:
    """Write a fleet's identities and server configuration into ``directory``,
    which must not exist yet or be empty (keys are never overwritten).
    ``jetstream_max_bytes``: the fleet account's JetStream file storage (None:
    :func:`default_jetstream_bytes`). ``tenants``: by name, each with an
    identity of its own. ``nodes``: node agents by name, each with its
    workers (none of ``worker_ids``)."""
    tenants = dict(tenants or {})
    node_workers = {node: list(workers) for node, workers in (nodes or {}).items()}
    _check_request(
        worker_ids, tls=tls, method=method, cluster_nodes=cluster_nodes, nodes=node_workers
    )
    routes = [_route_address(node) for node in cluster_nodes]
    if jetstream_max_bytes is None:
        jetstream_max_bytes = default_jetstream_bytes(cluster_nodes, tenants)
    if jetstream_max_bytes < MIN_JETSTREAM_BYTES:
        raise ValueError(
            f"the fleet's JetStream storage must be at least {MIN_JETSTREAM_BYTES} bytes "
            f"(its streams' smallest limits and room for its buckets), got {jetstream_max_bytes}"
        )
    directory = _new_directory(directory)
    authority = CertificateAuthority.create(directory) if tls else None
    server_tls = authority.issue_server(directory, hosts) if authority else None
    cluster = _cluster_block(authority, directory, routes) if authority and routes else ""
    layout = fleet_accounts(subjects, worker_ids, list(tenants), node_workers)
    writer = _IdentityWriter(
        directory, subjects, layout, method, authority, list(tenants), node_workers
    )
    roles = [Role.COORDINATOR, Role.ORCHESTRATOR, Role.AUDITOR, Role.OPERATOR]
    identities = [writer.write(role) for role in roles]
    identities += [writer.write(Role.AGENT, worker_id) for worker_id in worker_ids]
    identities += [writer.write(Role.NODE, node) for node in node_workers]
    identities += [writer.write(Role.TENANT, tenant) for tenant in tenants]
    # Whoever reads acks or beats (the coordinator; the orchestrator and the
    # operator in `status`, the auditor in `audit verify`) takes a node's
    # only for its own workers.
    for reader in identities[:4]:
        write_secret(reader.folder / NODES_FILE, encode_nodes(node_workers))
        with open(reader.env_file, "a") as env:
            env.write(f"{NODES_ENV}={reader.folder / NODES_FILE}\n")
    if tenants:
        # The coordinator enforces it; the operator makes each tenant's
        # adapter store by it (lorabus provision) and lists them.
        for identity in (identities[0], identities[3]):
            write_secret(identity.folder / TENANTS_FILE, encode_tenants(tenants))
            with open(identity.env_file, "a") as env:
                env.write(f"{TENANTS_ENV}={identity.folder / TENANTS_FILE}\n")
    accounts = writer.accounts_conf(jetstream_max_bytes)
    conf = directory / SERVER_CONF
    write_secret(conf, (_server_conf(subjects, accounts, server_tls, method) + cluster).encode())
    return FleetAuth(
        directory,
        conf,
        {identity.name: identity for identity in identities},
        authority.cert_file if authority is not None else None,
        writer.signing_key,
    )


def _check_request(
    worker_ids: Sequence[str],
    *,
    tls: bool,
    method: str,
    cluster_nodes: Sequence[str],
    nodes: Mapping[str, Sequence[str]],
) -> None:
    """ValueError for a combination of options ``lorabus auth init`` refuses."""
    if method not in ("nkey", "cert", "jwt"):
        raise ValueError(f"authentication method must be nkey, cert or jwt, not {method!r}")
    if method == "cert" and not tls:
        raise ValueError("cert authentication needs TLS")
    if cluster_nodes and not tls:
        raise ValueError("a cluster's routes need TLS: without it, anyone could join as a route")
    if len(set(worker_ids)) != len(worker_ids) or not (worker_ids or nodes):
        raise ValueError("give one or more distinct worker ids, or nodes")
    for worker in worker_ids:
        check_token("worker id", worker)
    check_nodes({node: list(workers) for node, workers in nodes.items()})
    on_nodes = {worker for workers in nodes.values() for worker in workers}
    both = sorted((on_nodes | set(nodes)) & set(worker_ids))
    if both:
        raise ValueError(
            f"{both[0]!r} is a lone agent's worker id and a node's (or a node's worker): "
            "give each worker one identity"
        )


def _new_directory(directory: Path) -> Path:
    """``directory``, resolved, and made (mode 0700) unless it exists empty."""
    directory = directory.resolve()
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory} is not empty: keys are never overwritten")
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    return directory


class _IdentityWriter:
    """Writes each identity's folder: its secret for the authentication
    ``method`` (an nkey seed, a JWT's ``.creds``, or none with ``cert``), its
    client certificate with TLS, the command-signing key (the coordinator) or
    its public key (agents), and its ``lorabus.env``; and gathers the users
    the server's configuration lists."""

    def __init__(
        self,
        directory: Path,
        subjects: Subjects,
        layout: FleetAccounts,
        method: str,
        authority: CertificateAuthority | None,
        tenants: Sequence[str] = (),
        nodes: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self._directory, self._subjects, self._layout = directory, subjects, layout
        self._tenants = tuple(tenants)
        self._nodes = dict(nodes or {})
        self._method, self._authority = method, authority
        self._jwts = JwtAuthority.create(layout) if method == "jwt" else None
        self._users: dict[str, list[str]] = {name: [] for name in layout.accounts}
        """Account -> its users' blocks (not with JWTs: each user is in its ``.creds``)."""
        self._signing_seed = new_signing_seed()
        self.signing_key = public_key_of(self._signing_seed)

    def write(self, role: Role, worker_id: str | None = None) -> Identity:
        name = identity_name(role, worker_id)
        folder = self._directory / name
        folder.mkdir(mode=0o700)
        if self._jwts is not None:
            prefix, env = self._jwt_user(self._jwts, folder, role, worker_id)
        else:
            prefix, env, user_key = (
                _nkey_user(folder) if self._method == "nkey" else _cert_user(name)
            )
            allowed = self._permissions(role, worker_id, prefix)
            account = self._layout.of_role[(role, worker_id)]
            self._users[account].append(_user_block(user_key, allowed, name))
        if self._authority is not None:
            cert, key = self._authority.issue_client(folder, name)
            env[ENV["tls_ca_file"]] = str(self._authority.cert_file)
            env[ENV["tls_cert_file"]], env[ENV["tls_key_file"]] = str(cert), str(key)
        env[ENV["inbox_prefix"]] = prefix
        if js_api_prefix(role):
            env[ENV["js_api_prefix"]] = js_api_prefix(role)
        if role is Role.COORDINATOR:
            write_secret(folder / SIGNING_SEED_FILE, self._signing_seed + b"\n")
            env[SIGNING_KEY_ENV] = str(folder / SIGNING_SEED_FILE)
        elif role in (Role.AGENT, Role.NODE):
            env[COORDINATOR_KEYS_ENV] = self.signing_key
            if role is Role.NODE:
                assert worker_id is not None
                env[NODE_ENV] = worker_id
        elif role is Role.TENANT:
            assert worker_id is not None
            env[TENANT_ENV] = worker_id
        identity = Identity(name, role, worker_id, folder, prefix)
        _write_env(identity.env_file, env)
        return identity

    def _permissions(self, role: Role, worker_id: str | None, prefix: str) -> Permissions:
        return permissions(
            role,
            self._subjects,
            inbox_prefix=prefix,
            worker_id=worker_id,
            tenants=self._tenants,
            node_workers=self._nodes.get(worker_id or "", ()) if role is Role.NODE else (),
        )

    def _jwt_user(
        self, jwts: JwtAuthority, folder: Path, role: Role, worker_id: str | None
    ) -> tuple[str, dict[str, str]]:
        """A user JWT in a ``.creds`` file: its inbox prefix and variables."""
        # The user's key is in its JWT: the inbox prefix comes from it too.
        seed = _new_user_seed()
        prefix = inbox_prefix_for(public_key_of(seed))
        allowed = self._permissions(role, worker_id, prefix)
        account, name = self._layout.of_role[(role, worker_id)], identity_name(role, worker_id)
        write_secret(folder / CREDS_FILE, jwts.user_creds(account, name, allowed, seed))
        return prefix, {ENV["creds_file"]: str(folder / CREDS_FILE)}

    def accounts_conf(self, jetstream_max_bytes: int) -> str:
        """The server configuration's accounts, and with JWTs the operator's and
        accounts' seeds (in ``jwt-keys/``, to sign more users)."""
        if self._jwts is None:
            return _accounts_conf(self._layout, self._users, jetstream_max_bytes)
        (self._directory / JWT_SEEDS).mkdir(mode=0o700)
        for file_name, seed in self._jwts.seeds().items():
            write_secret(self._directory / JWT_SEEDS / file_name, seed + b"\n")
        return self._jwts.server_conf(self._layout, jetstream_max_bytes=jetstream_max_bytes)


def _nkey_user(folder: Path) -> tuple[str, dict[str, str], tuple[str, str]]:
    """A user seed in its file: the inbox prefix, the variables and the user's key."""
    seed = _new_user_seed()
    write_secret(folder / SEED_FILE, seed + b"\n")
    public_key = public_key_of(seed)
    env = {ENV["nkey_seed_file"]: str(folder / SEED_FILE)}
    return inbox_prefix_for(public_key), env, ("nkey", public_key)


def _cert_user(name: str) -> tuple[str, dict[str, str], tuple[str, str]]:
    """No secret but the client certificate, whose subject the server maps to the user."""
    return f"_INBOX_{name.replace('-', '_')}", {}, ("user", f"CN={name}")


def _route_address(node: str) -> tuple[str, int]:
    """``host`` or ``host:port`` of a cluster node's route listener."""
    host, sep, port = node.rpartition(":") if ":" in node else (node, "", "")
    if not sep:
        return node, CLUSTER_PORT
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"cluster node {node!r} is not HOST or HOST:PORT")
    return host, int(port)


def _cluster_block(
    authority: CertificateAuthority, directory: Path, routes: list[tuple[str, int]]
) -> str:
    """The routes between the nodes, each authenticated twice: a certificate
    of the fleet's CA (mutual TLS) and the route user's password."""
    password = secrets.token_urlsafe(24)
    cert, key = authority.issue_route(directory, sorted({host for host, _ in routes}))
    urls = [f"nats-route://{ROUTE_USER}:{password}@{host}:{port}" for host, port in routes]
    return (
        "\n".join(
            [
                "# Routes: only a node with this password and a certificate of the fleet's CA",
                "# joins. Every node takes this block; its own route in the list is skipped.",
                f"# A node whose routes listen elsewhere than port {routes[0][1]} says so with",
                "# nats-server --cluster nats://0.0.0.0:<its port> (the rest of this block holds).",
                "cluster {",
                '  name: "lorabus"',
                f'  listen: "0.0.0.0:{routes[0][1]}"',
                f"  authorization {{ user: {json.dumps(ROUTE_USER)}, "
                f"password: {json.dumps(password)} }}",
                "  tls {",
                f"    cert_file: {json.dumps(str(cert))}",
                f"    key_file: {json.dumps(str(key))}",
                f"    ca_file: {json.dumps(str(authority.cert_file))}",
                "    verify: true",
                "  }",
                f"  routes: [{_quoted(urls)}]",
                "}",
            ]
        )
        + "\n"
    )


def _new_user_seed() -> bytes:
    import nkeys

    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))


def _write_env(path: Path, env: dict[str, str]) -> None:
    lines = ["# lorabus connects as this identity with these variables (no secrets here)."]
    lines += [f"{name}={value}" for name, value in sorted(env.items())]
    write_secret(path, ("\n".join(lines) + "\n").encode())


def _quoted(values: Sequence[str]) -> str:
    return ", ".join(json.dumps(value) for value in values)


def _user_block(user_key: tuple[str, str], allowed: Permissions, name: str) -> str:
    field, value = user_key
    responses = "\n          allow_responses: true" if allowed.allow_responses else ""
    return (
        f"      # {name}\n"
        f"      {{\n"
        f"        {field}: {json.dumps(value)}\n"
        f"        permissions: {{\n"
        f"          publish: {{ allow: [{_quoted(allowed.publish)}] }}\n"
        f"          subscribe: {{ allow: [{_quoted(allowed.subscribe)}] }}{responses}\n"
        f"        }}\n"
        f"      }}"
    )


def _account_block(account: Account, users: list[str], jetstream_max_bytes: int) -> str:
    lines = [f"  {json.dumps(account.name)} {{"]
    if account.jetstream:
        lines.append(f"    jetstream: {{ max_file: {jetstream_max_bytes} }}")
    lines += ["    users: [", ",\n".join(users), "    ]"]
    if account.exports:
        lines.append("    exports: [")
        for export in account.exports:
            kind = "service" if export.service else "stream"
            streamed = ", response_type: stream" if export.streamed else ""
            lines.append(
                f"      {{ {kind}: {json.dumps(export.subject)}, "
                f"accounts: [{_quoted(export.to)}]{streamed} }}"
            )
        lines.append("    ]")
    if account.imports:
        lines.append("    imports: [")
        for imported in account.imports:
            kind = "service" if imported.service else "stream"
            local = f", to: {json.dumps(imported.local)}" if imported.local else ""
            lines.append(
                f"      {{ {kind}: {{ account: {json.dumps(imported.account)}, "
                f"subject: {json.dumps(imported.subject)} }}{local} }}"
            )
        lines.append("    ]")
    lines.append("  }")
    return "\n".join(lines)


def _accounts_conf(
    layout: FleetAccounts, users: dict[str, list[str]], jetstream_max_bytes: int
) -> str:
    return "\n".join(
        [
            "accounts {",
            *(
                _account_block(account, users[name], jetstream_max_bytes)
                for name, account in layout.accounts.items()
            ),
            "}",
        ]
    )


def _server_conf(
    subjects: Subjects,
    accounts: str,
    server_tls: tuple[Path, Path, Path] | None,
    method: str,
) -> str:
    parts = [
        f"# The NATS identities of lorabus fleet {subjects.fleet!r} (lorabus auth init).",
        "# Listen address, port and JetStream store are given by flags, e.g.",
        "#   nats-server -c nats-server.conf -js -sd /var/lib/nats -p 4222",
    ]
    if server_tls is not None:
        cert, key, ca = server_tls
        mapping = "verify_and_map: true" if method == "cert" else "verify: true"
        parts += [
            "tls {",
            f"  cert_file: {json.dumps(str(cert))}",
            f"  key_file: {json.dumps(str(key))}",
            f"  ca_file: {json.dumps(str(ca))}",
            f"  {mapping}",
            "}",
        ]
    parts.append(accounts)
    return "\n".join(parts) + "\n"
