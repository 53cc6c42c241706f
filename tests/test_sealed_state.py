"""Fleet state that cannot be forged: records count only when the leader sealed them.

A coordinator with the fleet's signing key seals every record it stores
(leader, committed, in flight, resets, results) over the record and its KV
key. Whoever may write the fleet's buckets without that key (a leaked NATS
credential of a coordinator, a misconfigured permission) writes nothing
anyone acts on: a well-formed leader record with a higher epoch is neither
adopted by a pinned agent (which would fence out the real leader) nor obeyed
by the coordinators, who elect over it; and the next update commits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from hand_coordinator import HandCoordinator, real_agent
from nats.aio.msg import Msg

from lorabus.agents import AgentConfig
from lorabus.audit.render import status_text
from lorabus.bus.connect import close
from lorabus.schemas import (
    FleetStatus,
    Heartbeat,
    LeaderRecord,
    MemberStatus,
    PauseCommand,
    Subjects,
    encode,
    heartbeat_decoder,
)
from lorabus.schemas.codec import Reader
from lorabus.security.roles import Role
from lorabus.security.signing import CommandSigner, CommandVerifier, new_signing_seed
from lorabus.simfleet import SimFleet
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 30.0
leader_decoder = Reader(LeaderRecord)
WORKER = "w000"


def test_a_sealed_record_opens_only_for_its_own_key_and_a_trusted_signer() -> None:
    signer, stranger = CommandSigner(new_signing_seed()), CommandSigner(new_signing_seed())
    record = encode(LeaderRecord(holder="a", epoch=3, signing_key=signer.public_key))
    pinned = CommandVerifier([signer.public_key])

    assert pinned.open_record("leader", signer.seal("leader", record)) == record
    refusals = {
        "moved to another key": signer.seal("committed", record),
        "sealed by another key": stranger.seal("leader", record),
        "not sealed": record,
    }
    for why, value in refusals.items():
        with pytest.raises(ValueError):
            pinned.open_record("leader", value)
            pytest.fail(why)
    # A process that pins no key (a development fleet) reads both forms.
    assert CommandVerifier().open_record("leader", signer.seal("leader", record)) == record
    assert CommandVerifier().open_record("leader", record) == record


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    async with SimFleet([WORKER], [1]) as fleet:
        yield fleet


async def test_a_pinned_agent_ignores_a_leader_record_the_leader_did_not_seal(
    nats_url: str, fleet_name: str, hand: HandCoordinator, sim: SimFleet
) -> None:
    signer = CommandSigner(new_signing_seed())
    kv = await hand.nc.jetstream().create_key_value(bucket=hand.subjects.state_bucket())
    sealed = LeaderRecord(holder="hand", epoch=100, signing_key=signer.public_key)
    await kv.put("leader", signer.seal("leader", encode(sealed)))
    beats: asyncio.Queue[Heartbeat] = asyncio.Queue()

    async def on_beat(msg: Msg) -> None:
        beats.put_nowait(heartbeat_decoder.decode(msg.data))

    await hand.nc.subscribe(hand.subjects.heartbeat(WORKER), cb=on_beat)
    config = AgentConfig(
        fleet=fleet_name,
        worker_id=WORKER,
        system_url=sim.system_url(WORKER),
        world_size=1,
        heartbeat_s=0.2,
        coordinator_keys=[signer.public_key],
    )
    async with real_agent(nats_url, config, sim, "test-agent") as engine:
        # Well-formed, but written without the fleet's key: a higher epoch that
        # would fence out the real leader if the agent took it.
        forged = LeaderRecord(holder="usurper", epoch=500, signing_key=signer.public_key)
        await kv.put("leader", encode(forged))
        # A command of that epoch makes the agent read the record again.
        pause = PauseCommand(update_id="forged", targets=[WORKER], budget_s=5, epoch=500)
        await hand.nc.publish(hand.subjects.cmd_worker(WORKER), encode(pause))
        async with asyncio.timeout(DEADLINE_S):
            beat = await beats.get()
            while "leader" not in beat.unreadable_state:
                beat = await beats.get()
        assert beat.epoch_seen == 100, beat
        assert "not sealed" in beat.unreadable_state, beat.unreadable_state
        assert not engine.paused and engine.count_requests("POST", "/engine/pause_generation") == 0


@pytest.fixture
async def stack(fleet_name: str) -> AsyncIterator[EmbeddedStack]:
    async with EmbeddedStack(
        [1, 1], fleet=fleet_name, secure=True, heartbeat_s=0.2, leader_lease_s=1.0
    ) as started:
        yield started


async def test_a_forged_leader_record_is_elected_over_and_never_adopted(
    stack: EmbeddedStack, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None and stack.auth is not None
    s = Subjects(fleet=stack.fleet_name)
    first = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
    assert first.committed, first.error
    fleet_key = CommandVerifier([stack.auth.signing_key])

    # A leaked NATS credential of the coordinator role, without the signing key.
    nc = await stack.bus_as(Role.COORDINATOR).connect("test-leaked-coordinator")
    try:
        kv = await nc.jetstream().key_value(s.state_bucket())
        before = _leader(fleet_key, (await kv.get("leader")).value)
        forged = LeaderRecord(holder="usurper", epoch=before.epoch + 50, signing_key="")
        await kv.put("leader", encode(forged))

        async with asyncio.timeout(DEADLINE_S):
            # Polled under the deadline until a leader seals the record again.
            while (healed := _leader(fleet_key, (await kv.get("leader")).value)) is None:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        second = await stack.client.update("policy", make_adapter(2), version=2, timeout_s=30)
    finally:
        await close(nc)

    assert before is not None
    assert healed.holder == before.holder and healed.epoch > before.epoch, healed
    assert healed.epoch < forged.epoch, "the new term need not climb over a forged epoch"
    # An agent that had adopted the forged epoch would refuse the new term's
    # commands as fenced (its epoch is below 50 more): the update would fail.
    assert second.committed, second.error


def _leader(opener: CommandVerifier, value: bytes | None) -> LeaderRecord | None:
    """The leader record in ``value`` if the fleet's key sealed it, else None."""
    try:
        return leader_decoder.decode(opener.open_record("leader", value or b""))
    except ValueError:
        return None


def test_status_warns_of_a_member_that_ignores_state_it_cannot_trust() -> None:
    why = "leader: not sealed by the fleet's signing key"
    member = MemberStatus(
        worker_id=WORKER,
        world_size=1,
        engine="dynamo",
        paused=False,
        adapters=[],
        heartbeat_age_s=0.1,
        unreadable_state=why,
    )
    status = FleetStatus(fleet="f", expected_world_size=1, live_world_size=1, members=[member])
    assert f"WARNING: {WORKER} ignores fleet state it cannot trust: {why}" in status_text(status)
