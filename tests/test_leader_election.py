"""Leader election on a fake clock: who leads, when a standby takes over, when a
holder steps down. The store is in memory; the real KV store's election runs
in test_coordinator_failover.py."""

from __future__ import annotations

import asyncio

import pytest
from fleet_doubles import MemoryLeaderStore

from lorabus.coordinator.leader import LeaderElection
from lorabus.coordinator.signals import LeadershipLost
from lorabus.schemas import LeaderRecord

pytestmark = pytest.mark.looptime

LEASE_S = 4.0


def _now() -> float:
    return asyncio.get_running_loop().time()


async def test_the_first_coordinator_takes_an_empty_record_with_epoch_1() -> None:
    store = MemoryLeaderStore()
    assert await LeaderElection(store, "a", LEASE_S).campaign() == 1
    assert store.record == LeaderRecord(holder="a", epoch=1)


async def test_a_standby_takes_over_only_after_a_whole_lease_of_silence() -> None:
    store = MemoryLeaderStore()
    leader, standby = LeaderElection(store, "a", LEASE_S), LeaderElection(store, "b", LEASE_S)
    await leader.campaign()
    holding = asyncio.create_task(leader.hold())
    campaigning = asyncio.create_task(standby.campaign())

    await asyncio.sleep(10 * LEASE_S)
    assert not campaigning.done(), "the standby took over while the leader renewed"
    last_renewal = store.revision
    holding.cancel()  # the leader dies
    silent_from = _now()
    epoch = await asyncio.wait_for(campaigning, 2 * LEASE_S)

    assert epoch == 2 and store.record == LeaderRecord(holder="b", epoch=2)
    assert store.revision == last_renewal + 1
    assert _now() - silent_from >= LEASE_S - LEASE_S / 4, "taken over before a lease of silence"
    await asyncio.gather(holding, return_exceptions=True)


async def test_a_leader_whose_record_is_overwritten_loses_the_lease() -> None:
    store = MemoryLeaderStore()
    leader = LeaderElection(store, "a", LEASE_S)
    await leader.campaign()
    holding = asyncio.create_task(leader.hold())
    await asyncio.sleep(LEASE_S)
    await store.write_leader(LeaderRecord(holder="b", epoch=2), store.revision)

    with pytest.raises(LeadershipLost, match="another coordinator took the lease"):
        await asyncio.wait_for(holding, LEASE_S)


async def test_a_leader_that_cannot_renew_steps_down_before_a_standby_may_take_over() -> None:
    store = MemoryLeaderStore()
    leader = LeaderElection(store, "a", LEASE_S)
    await leader.campaign()
    holding = asyncio.create_task(leader.hold())
    await asyncio.sleep(LEASE_S)
    store.reachable = False
    cut_off = _now()

    with pytest.raises(LeadershipLost, match="could not renew"):
        await asyncio.wait_for(holding, 2 * LEASE_S)
    # At the latest one renewal period after the cut, and well before the
    # whole lease of silence after which a standby takes over.
    assert _now() - cut_off < LEASE_S


async def test_a_coordinator_that_stepped_down_takes_back_its_untouched_record_at_once() -> None:
    store = MemoryLeaderStore()
    election = LeaderElection(store, "a", LEASE_S)
    await election.campaign()
    store.reachable = False
    with pytest.raises(LeadershipLost):
        await election.hold()
    store.reachable = True
    started = _now()

    assert await election.campaign() == 2
    assert _now() == started, "its own record needs no lease of silence"


async def test_a_coordinator_that_stood_aside_leaves_the_lease_to_a_watching_standby() -> None:
    """A leader that steps down on purpose (it cannot read what its predecessor
    left) campaigns again behind any standby: one watching the record takes
    it, instead of the same coordinator at once; with none, it takes the
    lease back after two leases of silence."""
    store = MemoryLeaderStore()
    leader, standby = LeaderElection(store, "a", LEASE_S), LeaderElection(store, "b", LEASE_S)
    await leader.campaign()
    watching = asyncio.create_task(standby.campaign())
    await asyncio.sleep(LEASE_S / 2)  # the record, renewed a moment ago
    leader.stand_aside()
    again = asyncio.create_task(leader.campaign())

    epoch = await asyncio.wait_for(watching, 2 * LEASE_S)
    assert epoch == 2 and store.record == LeaderRecord(holder="b", epoch=2)
    assert not again.done(), "the coordinator that stood aside took the lease back"
    again.cancel()
    await asyncio.gather(again, return_exceptions=True)


async def test_a_coordinator_that_stood_aside_with_no_standby_leads_again() -> None:
    store = MemoryLeaderStore()
    election = LeaderElection(store, "a", LEASE_S)
    await election.campaign()
    election.stand_aside()

    assert await asyncio.wait_for(election.campaign(), 3 * LEASE_S) == 2
    assert store.record == LeaderRecord(holder="a", epoch=2)
