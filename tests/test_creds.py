"""``--creds``: a user of an operator-managed account (a user JWT and its nkey
seed) connects, gets exactly the permissions in its JWT, and a user another
operator signed is refused; against a real nats-server in operator mode."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from jwt_minting import Account
from secured import watched

from lorabus import BusOptions, PermissionDenied
from lorabus.bus.connect import Bus, close, connect
from lorabus.schemas import Subjects
from lorabus.testbed.natsserver import NatsServer

SUBJECTS = Subjects(fleet="creds")


@pytest.fixture
async def operated(tmp_path: Path) -> AsyncIterator[tuple[NatsServer, Account]]:
    account = Account.new("LORABUS_CREDS")
    conf = tmp_path / "operator.conf"
    conf.write_text(account.server_conf())
    async with NatsServer(include=conf) as server:
        yield server, account


async def test_a_creds_file_connects_with_the_permissions_of_its_jwt(
    operated: tuple[NatsServer, Account], tmp_path: Path
) -> None:
    server, account = operated
    creds = account.creds(
        tmp_path / "agent.creds",
        "agent-w000",
        publish=[SUBJECTS.heartbeat("w000")],
        subscribe=[SUBJECTS.cmd(), "_INBOX_agent_w000.>"],
    )
    options = BusOptions(creds_file=str(creds), inbox_prefix="_INBOX_agent_w000")
    nc = await connect(server.url, name="test-creds", options=options)
    await close(nc)
    async with watched(Bus(server.url, options)) as client:
        await client.nc.publish(SUBJECTS.heartbeat("w000"), b"{}")
        await client.nc.publish(SUBJECTS.heartbeat("w001"), b"{}")
        await client.nc.flush()
        await client.wait_refusal("publish", SUBJECTS.heartbeat("w001"))
        assert len(client.refusals()) == 1, client.refusals()


async def test_a_user_another_operator_signed_is_refused(
    operated: tuple[NatsServer, Account], tmp_path: Path
) -> None:
    server, _ = operated
    stranger = Account.new("ELSEWHERE").creds(
        tmp_path / "x.creds", "x", publish=[">"], subscribe=[">"]
    )
    with pytest.raises(PermissionDenied, match="authorization violation"):
        await connect(
            server.url, name="test-stranger", options=BusOptions(creds_file=str(stranger))
        )
