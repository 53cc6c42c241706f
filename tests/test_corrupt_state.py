"""No single record of the store that does not decode stops the fleet.

Garbage in the leader key (a leaked credential, a bug) is elected over: at
once by the coordinator whose lease it overwrote, after a lease of silence by
a coordinator that finds it; garbage in an adapter's commit point, in the
latest record or in the in-flight record is reported and replaced by what is
safe, and the next update commits. Each is checked on a fake clock with the
election alone, and on a real nats-server with the whole fleet.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import nats.js.errors
import pytest
from fleet_doubles import MemoryLeaderStore
from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from lorabus.bus.connect import close, connect
from lorabus.coordinator.config import StorageConfig
from lorabus.coordinator.leader import LeaderElection
from lorabus.coordinator.store import CorruptRecord, FleetStore
from lorabus.schemas import LeaderRecord, Subjects
from lorabus.testbed.stack import EmbeddedStack

LEASE_S = 4.0
GARBAGE = b'{"type":"fleet_status","epoch":1}'
"""An answer that once landed on the leader key: JSON, but no leader record."""


class GarbledLeaderStore(MemoryLeaderStore):
    """The in-memory leader record, which :meth:`garble` overwrites with a
    record that does not decode (a new revision, as a KV put makes)."""

    def __init__(self) -> None:
        super().__init__()
        self.garbled = False

    def garble(self) -> None:
        self.record, self.revision, self.garbled = None, self.revision + 1, True

    async def read_leader(self) -> tuple[LeaderRecord | None, int]:
        if self.garbled:
            raise CorruptRecord("leader", self.revision, "missing holder", repr(GARBAGE))
        return await super().read_leader()

    async def write_leader(self, record: LeaderRecord, last_revision: int) -> int:
        revision = await super().write_leader(record, last_revision)
        self.garbled = False
        return revision


@pytest.mark.looptime
async def test_the_holder_whose_lease_garbage_overwrote_leads_again_at_once() -> None:
    store = GarbledLeaderStore()
    reported: list[CorruptRecord] = []

    async def report(corrupt: CorruptRecord) -> None:
        reported.append(corrupt)

    election = LeaderElection(store, "a", LEASE_S, on_corrupt=report)
    await election.campaign()
    holding = asyncio.create_task(election.hold())
    await asyncio.sleep(LEASE_S)
    store.garble()
    with pytest.raises(Exception, match="another coordinator took the lease"):
        await asyncio.wait_for(holding, LEASE_S)
    garbled_at = asyncio.get_running_loop().time()

    epoch = await asyncio.wait_for(election.campaign(), LEASE_S)

    assert epoch == 2 and store.record == LeaderRecord(holder="a", epoch=2)
    assert asyncio.get_running_loop().time() - garbled_at < LEASE_S / 2
    assert [c.revision for c in reported] == [store.revision - 1]


@pytest.mark.looptime
async def test_a_coordinator_finding_garbage_leads_after_a_lease_past_every_epoch_seen() -> None:
    """Nobody holds a lease over it: the garbage is taken over like a dead
    holder's record, with an epoch past what the agents' heartbeats show."""
    store = GarbledLeaderStore()
    await store.write_leader(LeaderRecord(holder="gone", epoch=6), 0)
    store.garble()
    election = LeaderElection(store, "b", LEASE_S, epoch_floor=lambda: 7)
    started = asyncio.get_running_loop().time()

    epoch = await asyncio.wait_for(election.campaign(), 3 * LEASE_S)

    assert epoch == 8 and store.record == LeaderRecord(holder="b", epoch=8)
    assert asyncio.get_running_loop().time() - started >= LEASE_S - LEASE_S / 4


# -- the whole fleet, on a real server ------------------------------------------

FLEET_LEASE_S = 1.0


async def _state_bucket(nc: NatsClient, fleet: str):  # type: ignore[no-untyped-def]
    await FleetStore.open(nc, StorageConfig(fleet=fleet))  # sets the fleet up if nobody did
    return await nc.jetstream().key_value(Subjects(fleet=fleet).state_bucket())


async def _until_settled(kv) -> None:  # type: ignore[no-untyped-def]
    """Until the last update's writes after its answer landed (its in-flight
    record goes last): else a successor rebuilds its commit point from them."""
    async with asyncio.timeout(10):
        while True:
            try:
                await kv.get("inflight")
            except nats.js.errors.KeyNotFoundError:
                return
            await asyncio.sleep(0.05)


async def _reported(sub: Subscription, key: str) -> str:
    """The ``bad_message`` event the coordinator emits about ``key``."""
    while True:
        event = msgspec.json.decode((await sub.next_msg(timeout=10)).data)
        if event["subject"].endswith(f".{key}"):
            return str(event["error"])


async def test_garbage_in_the_leader_key_is_healed_within_a_lease_and_updates_commit(
    nats_url: str,
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
    make_adapter: Callable[[int], str],
) -> None:
    nc = await connect(nats_url, name="test-garbler")
    try:
        events = await nc.subscribe(Subjects(fleet=fleet_name).coordinator_event("bad_message"))
        async with make_stack([1, 1], leader_lease_s=FLEET_LEASE_S) as stack:
            assert stack.client is not None and stack.coordinator is not None
            first = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
            assert first.committed, first.error
            kv = await _state_bucket(nc, fleet_name)
            await kv.put("leader", GARBAGE)

            async with asyncio.timeout(2 * FLEET_LEASE_S):
                error = await _reported(events, "leader")
                while True:  # the new term's record: the signal is its revision moving
                    entry = await kv.get("leader")
                    if entry.value != GARBAGE:
                        break
                    await asyncio.sleep(FLEET_LEASE_S / 10)
            record = msgspec.json.decode(entry.value, type=LeaderRecord)
            assert record.holder == stack.coordinator.holder and record.epoch == 2
            assert "does not decode" in error

            second = await stack.client.update("policy", make_adapter(2), version=2, timeout_s=30)
            assert second.committed, second.error
    finally:
        await close(nc)


async def test_a_fleet_started_on_a_garbled_leader_key_leads(
    nats_url: str,
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
    make_adapter: Callable[[int], str],
) -> None:
    nc = await connect(nats_url, name="test-garbler")
    try:
        kv = await _state_bucket(nc, fleet_name)
        await kv.put("leader", GARBAGE)
        async with make_stack([1], leader_lease_s=FLEET_LEASE_S) as stack:
            assert stack.client is not None
            result = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
            assert result.committed, result.error
    finally:
        await close(nc)


@pytest.mark.parametrize("key", ["committed.policy", "committed", "inflight"])
async def test_a_garbled_state_record_is_reported_and_the_next_update_commits(
    key: str,
    nats_url: str,
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
    make_adapter: Callable[[int], str],
) -> None:
    """A leader finds garbage where its predecessor's commit point, latest
    record or in-flight record was; an adapter whose commit point is lost is
    reset to a new lineage (recorded as ``committed_reset``), so that no
    served name is reused whatever version comes next."""
    s = Subjects(fleet=fleet_name)
    nc = await connect(nats_url, name="test-garbler")
    try:
        events = await nc.subscribe(s.coordinator_event("bad_message"))
        resets = await nc.subscribe(s.coordinator_event("committed_reset"))
        async with make_stack([1, 1], leader_lease_s=FLEET_LEASE_S) as stack:
            assert stack.client is not None
            first = await stack.client.update("policy", make_adapter(3), version=3, timeout_s=30)
            assert first.committed, first.error
            kv = await _state_bucket(nc, fleet_name)
            await _until_settled(kv)
        await kv.put(key, GARBAGE)

        async with make_stack([1, 1], leader_lease_s=FLEET_LEASE_S) as stack:
            assert stack.client is not None
            error = await _reported(events, key)
            assert "does not decode" in error
            version = 1 if key == "committed.policy" else 4
            result = await stack.client.update(
                "policy", make_adapter(version), version=version, timeout_s=30
            )
            assert result.committed, result.error
            if key == "committed.policy":
                reset = msgspec.json.decode((await resets.next_msg(timeout=10)).data)
                assert reset["adapter"] == "policy" and reset["lineage"] == 1
                assert result.adapter == "policy-r1-v1"
            store = await FleetStore.open(nc, StorageConfig(fleet=fleet_name))
            latest = await store.read_committed()
            assert latest is not None and latest.version == version
    finally:
        await close(nc)
