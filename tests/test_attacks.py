"""The attacks that once took a fleet over, replayed against a secured one.

Each runs through a client with credentials that are not the coordinator's
(or with none) against a stack set up by ``lorabus auth init``; none changes
anything: no engine pauses, the coordinator keeps leading, and the
orchestrator gets the true result.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
from nats.aio.msg import Msg
from secured import watched

from lorabus import BusOptions, PermissionDenied
from lorabus.bus.connect import Bus, connect
from lorabus.schemas import (
    COMMITTED,
    CommittedNotice,
    LeaderRecord,
    PauseCommand,
    Subjects,
    UpdateResult,
    encode,
)
from lorabus.security.roles import Role
from lorabus.testbed.stack import EmbeddedStack


@pytest.fixture
async def stack(fleet_name: str) -> AsyncIterator[EmbeddedStack]:
    async with EmbeddedStack([1, 2], fleet=fleet_name, secure=True, heartbeat_s=0.2) as started:
        yield started


def _pauses(stack: EmbeddedStack) -> int:
    assert stack.sim is not None
    return sum(
        w.count_requests("POST", "/engine/pause_generation") for w in stack.sim.workers.values()
    )


async def test_a_forged_pause_with_a_huge_epoch_and_no_lease_pauses_nothing(
    stack: EmbeddedStack, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None
    subjects = Subjects(fleet=stack.fleet_name)
    before = _pauses(stack)
    async with watched(stack.bus_as(Role.ORCHESTRATOR)) as attacker:
        for worker_id in ("w000", "w001"):
            forged = PauseCommand(
                update_id="forged", targets=[worker_id], budget_s=30, epoch=1_000_000, lease_s=0
            )
            await attacker.nc.publish(subjects.cmd_worker(worker_id), encode(forged))
        await attacker.nc.flush()
        await attacker.wait_refusal("publish", subjects.cmd_worker("w001"))

    assert _pauses(stack) == before
    result = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
    assert result.committed, result.error  # not "fenced": no agent saw epoch 1000000


async def test_a_forged_committed_notice_makes_no_agent_unload_or_load(
    stack: EmbeddedStack, make_adapter: Callable[[int], str], tmp_path: object
) -> None:
    assert stack.client is not None and stack.sim is not None
    result = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
    assert result.committed, result.error
    loads_before = sum(w.loads_received for w in stack.sim.workers.values())
    subjects = Subjects(fleet=stack.fleet_name)
    forged = CommittedNotice(
        update_id="forged",
        budget_s=30,
        epoch=1_000_000,
        served_name="evil-v1",
        path="/etc",
        version=99,
        retire=["policy-v1"],
    )
    async with watched(stack.bus_as(Role.AGENT, "w000")) as attacker:
        await attacker.nc.publish(subjects.cmd(), encode(forged))
        await attacker.nc.flush()
        await attacker.wait_refusal("publish", subjects.cmd())

    status = await stack.client.status()
    assert all(m.adapters == ["policy-v1"] for m in status.members), status.members
    assert sum(w.loads_received for w in stack.sim.workers.values()) == loads_before
    assert all("evil-v1" not in w.adapters for w in stack.sim.workers.values())


async def test_a_rogue_responder_cannot_answer_the_orchestrators_request(
    stack: EmbeddedStack, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None
    subjects = Subjects(fleet=stack.fleet_name)
    forged = UpdateResult(update_id="", status=COMMITTED, adapter="evil", version=1)

    async with watched(stack.bus_as(Role.ORCHESTRATOR)) as rogue:

        async def answer(msg: Msg) -> None:
            await msg.respond(encode(forged))

        await rogue.nc.subscribe(subjects.update_request(), cb=answer)
        await rogue.nc.flush()
        await rogue.wait_refusal("subscription", subjects.update_request())
        result = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)

    assert result.committed and result.adapter == "policy-v1"
    assert result.rank_map is not None
    assert [e.worker_id for e in result.rank_map.entries] == ["w000", "w001"]


async def test_writing_the_leader_record_leaves_the_leader_in_place(
    stack: EmbeddedStack, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None and stack.coordinator is not None
    subjects = Subjects(fleet=stack.fleet_name)
    record = encode(LeaderRecord(holder="attacker", epoch=1_000_000))
    async with watched(stack.bus_as(Role.AGENT, "w001")) as attacker:
        kv_subject = f"$KV.{subjects.state_bucket()}.leader"
        for _ in range(20):  # a whole leader lease of writes, one every 0.1 s of it
            await attacker.nc.publish(kv_subject, record)
            await asyncio.sleep(0.1)
        await attacker.wait_refusal("publish", kv_subject)

    status = await stack.client.status()
    assert (status.leader, status.epoch) == (stack.coordinator.holder, 1)
    result = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
    assert result.committed, result.error


async def test_a_client_without_credentials_is_refused_at_connect(stack: EmbeddedStack) -> None:
    assert stack.auth is not None and stack.auth.ca_file is not None
    # The CA is public: with it alone, the server still wants a client certificate.
    anonymous = BusOptions(tls_ca_file=str(stack.auth.ca_file))
    with pytest.raises(PermissionDenied, match=r"TLS: .* refused this client"):
        await connect(stack.nats_url, name="test-anonymous", options=anonymous)
    # A certificate alone (a copied one, say) is not an identity either.
    certificate_only = msgspec.structs.replace(
        stack.bus_as(Role.ORCHESTRATOR).options, nkey_seed_file=None
    )
    with pytest.raises(PermissionDenied, match="authorization violation"):
        await connect(stack.nats_url, name="test-certificate-only", options=certificate_only)


async def test_another_fleets_identity_is_refused_at_connect(
    stack: EmbeddedStack, fleet_name: str
) -> None:
    async with EmbeddedStack([1], fleet=f"{fleet_name}x", secure=True) as other:
        # This server's TLS, another fleet's coordinator key.
        stranger = msgspec.structs.replace(
            stack.bus_as(Role.ORCHESTRATOR).options,
            nkey_seed_file=other.bus_as(Role.COORDINATOR).options.nkey_seed_file,
        )
        with pytest.raises(PermissionDenied, match="authorization violation"):
            await Bus(stack.nats_url, stranger).connect("test-stranger")
