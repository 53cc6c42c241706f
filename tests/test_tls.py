"""TLS as lorabus auth init sets it up: mutual TLS, and certificates mapped to users."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from secured import watched

from lorabus import BusUnreachable, PermissionDenied
from lorabus.bus.connect import Bus, close, connect
from lorabus.bus.options import BusOptions
from lorabus.schemas import Subjects
from lorabus.security.auth_init import FleetAuth, write_fleet_auth
from lorabus.security.roles import Role
from lorabus.testbed.natsserver import NatsServer

FLEET = "tls"


def _options(auth: FleetAuth, role: Role, worker_id: str | None = None) -> BusOptions:
    folder = auth.identity(role, worker_id).folder
    return BusOptions.of_identity(folder)


@pytest.fixture
async def server_of(tmp_path: Path) -> AsyncIterator[tuple[NatsServer, FleetAuth, FleetAuth]]:
    """A server set up for fleet ``tls`` (nkeys and mutual TLS), and another
    fleet's identities from another CA."""
    auth = write_fleet_auth(tmp_path / "ours", Subjects(fleet=FLEET), ["w000", "w001"], tls=True)
    other = write_fleet_auth(tmp_path / "theirs", Subjects(fleet=FLEET), ["w000"], tls=True)
    async with NatsServer(include=auth.server_conf) as server:
        yield server, auth, other


def _url(server: NatsServer) -> str:
    return f"tls://127.0.0.1:{server.port}"


async def test_a_client_certificate_from_another_ca_is_refused(
    server_of: tuple[NatsServer, FleetAuth, FleetAuth],
) -> None:
    server, auth, other = server_of
    ours = _options(auth, Role.ORCHESTRATOR)
    foreign_certificate = msgspec.structs.replace(
        ours,
        tls_cert_file=_options(other, Role.ORCHESTRATOR).tls_cert_file,
        tls_key_file=_options(other, Role.ORCHESTRATOR).tls_key_file,
    )
    with pytest.raises(PermissionDenied, match="TLS"):
        await connect(_url(server), name="test-foreign", options=foreign_certificate)


async def test_a_client_that_does_not_trust_the_servers_ca_says_so(
    server_of: tuple[NatsServer, FleetAuth, FleetAuth],
) -> None:
    server, auth, other = server_of
    wrong_ca = msgspec.structs.replace(
        _options(auth, Role.ORCHESTRATOR), tls_ca_file=_options(other, Role.AUDITOR).tls_ca_file
    )
    with pytest.raises(BusUnreachable, match="cannot verify the certificate"):
        await connect(_url(server), name="test-wrong-ca", options=wrong_ca)


async def test_the_right_certificate_and_key_connect(
    server_of: tuple[NatsServer, FleetAuth, FleetAuth],
) -> None:
    server, auth, _ = server_of
    nc = await Bus(_url(server), _options(auth, Role.ORCHESTRATOR)).connect("test-ok")
    await close(nc)


async def test_a_certificate_mapped_to_an_agent_gets_exactly_its_permissions(
    tmp_path: Path,
) -> None:
    auth = write_fleet_auth(
        tmp_path / "certs", Subjects(fleet=FLEET), ["w000", "w001"], tls=True, method="cert"
    )
    subjects = Subjects(fleet=FLEET)
    agent = _options(auth, Role.AGENT, "w000")
    assert agent.nkey_seed_file is None and agent.tls_cert_file is not None
    async with NatsServer(include=auth.server_conf) as server:
        async with watched(Bus(_url(server), agent)) as client:
            await client.nc.publish(subjects.heartbeat("w000"), b"{}")
            await client.nc.publish(subjects.heartbeat("w001"), b"{}")
            await client.nc.subscribe(subjects.cmd_worker("w001"))
            await client.nc.subscribe(subjects.cmd_worker("w000"))
            await client.nc.flush()
            await client.wait_refusal("publish", subjects.heartbeat("w001"))
            await client.wait_refusal("subscription", subjects.cmd_worker("w001"))
            assert len(client.refusals()) == 2, client.refusals()


def test_certificates_are_never_writable_by_others_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        auth = write_fleet_auth(
            tmp_path / "auth",
            Subjects(fleet="modes"),
            ["w000"],
            tls=True,
            cluster_nodes=["nats-1", "nats-2"],
        )
    finally:
        os.umask(old)
    pems = sorted(auth.directory.rglob("*.pem"))
    assert auth.ca_file in pems and any(p.name == "route-cert.pem" for p in pems)
    for pem in pems:
        mode = stat.S_IMODE(pem.stat().st_mode)
        assert mode & 0o022 == 0, f"{pem.relative_to(auth.directory)} is {oct(mode)}"
        if "key" in pem.name:
            assert mode == 0o600, f"{pem.relative_to(auth.directory)} is {oct(mode)}"
