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

import datetime
import ipaddress
import json
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from lorabus.bus.options import ENV, ENV_FILE, inbox_prefix_for, public_key_of
from lorabus.schemas import Subjects, check_token
from lorabus.security.accounts import Account, FleetAccounts, fleet_accounts, js_api_prefix
from lorabus.security.auth_jwt import JwtAuthority
from lorabus.security.roles import Permissions, Role, identity_name, permissions
from lorabus.security.signing import COORDINATOR_KEYS_ENV, SIGNING_KEY_ENV, new_signing_seed

SERVER_CONF = "nats-server.conf"
SEED_FILE = "nkey.seed"
CREDS_FILE = "user.creds"
JWT_SEEDS = "jwt-keys"
"""With ``--method jwt``: the operator's and the accounts' seeds, to sign more."""
SIGNING_SEED_FILE = "command-signing.seed"
"""In the coordinator's folder: the key its commands are signed with. Every
coordinator of the fleet (run two or more for failover) uses this one key."""
CERTIFICATE_DAYS = 365
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
limit when it is made, and refuses one the budget cannot hold."""
MIN_JETSTREAM_BYTES = 64 << 20


def default_jetstream_bytes(cluster_nodes: Sequence[str] = ()) -> int:
    """The fleet account's JetStream storage: JetStream counts every replica of
    a stream against it, so on a cluster it is the budget times the nodes."""
    return JETSTREAM_BYTES_PER_REPLICA * max(1, len(cluster_nodes))


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
) -> FleetAuth:
    """Write a fleet's identities and server configuration into ``directory``,
    which must not exist yet or be empty (keys are never overwritten).
    ``jetstream_max_bytes``: the fleet account's JetStream file storage (None:
    :func:`default_jetstream_bytes`)."""
    if method not in ("nkey", "cert", "jwt"):
        raise ValueError(f"authentication method must be nkey, cert or jwt, not {method!r}")
    if method == "cert" and not tls:
        raise ValueError("cert authentication needs TLS")
    if cluster_nodes and not tls:
        raise ValueError("a cluster's routes need TLS: without it, anyone could join as a route")
    routes = [_route_address(node) for node in cluster_nodes]
    if len(set(worker_ids)) != len(worker_ids) or not worker_ids:
        raise ValueError("give one or more distinct worker ids")
    if jetstream_max_bytes is None:
        jetstream_max_bytes = default_jetstream_bytes(cluster_nodes)
    if jetstream_max_bytes < MIN_JETSTREAM_BYTES:
        raise ValueError(
            f"the fleet's JetStream storage must be at least {MIN_JETSTREAM_BYTES} bytes "
            f"(its streams' smallest limits and room for its buckets), got {jetstream_max_bytes}"
        )
    for worker in worker_ids:
        check_token("worker id", worker)
    directory = directory.resolve()
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory} is not empty: keys are never overwritten")
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)

    roles: list[tuple[Role, str | None]] = [
        (Role.COORDINATOR, None),
        (Role.ORCHESTRATOR, None),
        (Role.AUDITOR, None),
        (Role.OPERATOR, None),
        *((Role.AGENT, worker_id) for worker_id in worker_ids),
    ]
    signing_seed = new_signing_seed()
    signing_key = public_key_of(signing_seed)
    authority = _CertificateAuthority.create(directory) if tls else None
    server_tls = authority.issue_server(directory, hosts) if authority else None
    cluster = _cluster_block(authority, directory, routes) if authority and routes else ""
    identities: dict[str, Identity] = {}
    layout = fleet_accounts(subjects, worker_ids)
    users: dict[str, list[str]] = {name: [] for name in layout.accounts}
    jwts = JwtAuthority.create(layout) if method == "jwt" else None
    for role, worker_id in roles:
        name = identity_name(role, worker_id)
        account = layout.of_role[(role, worker_id)]
        folder = directory / name
        folder.mkdir(mode=0o700)
        env: dict[str, str] = {}
        if jwts is not None:
            # The user's key is in its JWT: the inbox prefix comes from it too.
            user = _new_user_seed()
            prefix = inbox_prefix_for(public_key_of(user))
            allowed = permissions(role, subjects, inbox_prefix=prefix, worker_id=worker_id)
            _write_secret(folder / CREDS_FILE, jwts.user_creds(account, name, allowed, user))
            env[ENV["creds_file"]] = str(folder / CREDS_FILE)
        elif method == "nkey":
            seed = _new_user_seed()
            _write_secret(folder / SEED_FILE, seed + b"\n")
            public_key = public_key_of(seed)
            prefix = inbox_prefix_for(public_key)
            user_key = ("nkey", public_key)
            env[ENV["nkey_seed_file"]] = str(folder / SEED_FILE)
        else:
            prefix = f"_INBOX_{name.replace('-', '_')}"
            user_key = ("user", f"CN={name}")
        if authority is not None:
            cert, key = authority.issue_client(folder, name)
            env[ENV["tls_ca_file"]] = str(authority.cert_file)
            env[ENV["tls_cert_file"]], env[ENV["tls_key_file"]] = str(cert), str(key)
        env[ENV["inbox_prefix"]] = prefix
        if js_api_prefix(role):
            env[ENV["js_api_prefix"]] = js_api_prefix(role)
        if role is Role.COORDINATOR:
            _write_secret(folder / SIGNING_SEED_FILE, signing_seed + b"\n")
            env[SIGNING_KEY_ENV] = str(folder / SIGNING_SEED_FILE)
        elif role is Role.AGENT:
            env[COORDINATOR_KEYS_ENV] = signing_key
        identity = Identity(name, role, worker_id, folder, prefix)
        identities[name] = identity
        if jwts is None:
            allowed = permissions(role, subjects, inbox_prefix=prefix, worker_id=worker_id)
            users[account].append(_user_block(user_key, allowed, name))
        _write_env(identity.env_file, env)

    conf = directory / SERVER_CONF
    if jwts is not None:
        (directory / JWT_SEEDS).mkdir(mode=0o700)
        for file_name, seed in jwts.seeds().items():
            _write_secret(directory / JWT_SEEDS / file_name, seed + b"\n")
        accounts = jwts.server_conf(layout, jetstream_max_bytes=jetstream_max_bytes)
    else:
        accounts = _accounts_conf(layout, users, jetstream_max_bytes)
    text = _server_conf(subjects, accounts, server_tls, method) + cluster
    _write_secret(conf, text.encode())
    return FleetAuth(
        directory,
        conf,
        identities,
        authority.cert_file if authority is not None else None,
        signing_key,
    )


def _route_address(node: str) -> tuple[str, int]:
    """``host`` or ``host:port`` of a cluster node's route listener."""
    host, sep, port = node.rpartition(":") if ":" in node else (node, "", "")
    if not sep:
        return node, CLUSTER_PORT
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"cluster node {node!r} is not HOST or HOST:PORT")
    return host, int(port)


def _cluster_block(
    authority: _CertificateAuthority, directory: Path, routes: list[tuple[str, int]]
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


def _write_secret(path: Path, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def _write_public(path: Path, data: bytes) -> None:
    """A certificate: 0644 at most, whatever the umask (a plain write asks for
    0666, which umask 000 leaves writable by anyone)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def _write_env(path: Path, env: dict[str, str]) -> None:
    lines = ["# lorabus connects as this identity with these variables (no secrets here)."]
    lines += [f"{name}={value}" for name, value in sorted(env.items())]
    _write_secret(path, ("\n".join(lines) + "\n").encode())


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


class _CertificateAuthority:
    """A CA of one fleet, for its server and client certificates."""

    def __init__(
        self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate, cert_file: Path
    ) -> None:
        self._key = key
        self._cert = cert
        self.cert_file = cert_file

    @classmethod
    def create(cls, directory: Path) -> _CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lorabus fleet CA")])
        cert = (
            _builder(name, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        cert_file = directory / "ca.pem"
        _write_public(cert_file, cert.public_bytes(serialization.Encoding.PEM))
        _write_secret(directory / "ca-key.pem", _pem_key(key))
        return cls(key, cert, cert_file)

    def issue_server(self, directory: Path, hosts: Sequence[str]) -> tuple[Path, Path, Path]:
        folder = directory / "server"
        folder.mkdir(mode=0o700)
        cert, key = self._issue(
            folder, "server", hosts[0], [ExtendedKeyUsageOID.SERVER_AUTH], _general_names(hosts)
        )
        return cert, key, self.cert_file

    def issue_client(self, folder: Path, name: str) -> tuple[Path, Path]:
        return self._issue(folder, "client", name, [ExtendedKeyUsageOID.CLIENT_AUTH], [])

    def issue_route(self, directory: Path, hosts: Sequence[str]) -> tuple[Path, Path]:
        """One certificate for every node's routes: a route both dials and
        answers, so it is a client and a server certificate at once."""
        return self._issue(
            directory / "server",
            "route",
            "lorabus route",
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
            _general_names(hosts),
        )

    def _issue(
        self,
        folder: Path,
        stem: str,
        common_name: str,
        usage: list[x509.ObjectIdentifier],
        names: list[x509.GeneralName],
    ) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        builder = _builder(subject, self._cert.subject, key.public_key()).add_extension(
            x509.ExtendedKeyUsage(usage), critical=False
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        cert_file, key_file = folder / f"{stem}-cert.pem", folder / f"{stem}-key.pem"
        _write_public(cert_file, cert.public_bytes(serialization.Encoding.PEM))
        _write_secret(key_file, _pem_key(key))
        return cert_file, key_file


def _general_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERTIFICATE_DAYS))
    )


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
