"""A leader deposed or cut off mid-update, with the real coordinators and
agents in memory: who answers, what is recorded, and that no engine is left
paused. The same hand-over with real processes killed and a real nats-server
is in test_coordinator_failover.py and test_requester_failover.py; the
store's records as a dead predecessor left them, read from a real JetStream
KV, in test_recovery.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
from memory_fleet import InMemoryFleet
from store_helpers import in_flight_of

from lorabus.coordinator.store import FleetStore
from lorabus.coordinator.term import Term
from lorabus.schemas import (
    ErrorCode,
    LeaderRecord,
    UpdateRequest,
    UpdateResult,
    encode,
    update_result_decoder,
)

pytestmark = pytest.mark.looptime

WORLD_SIZES = {"w0": 1, "w1": 1}
OpenFleet = Callable[..., Awaitable[InMemoryFleet]]


@pytest.fixture
async def open_fleet() -> AsyncIterator[OpenFleet]:
    async with AsyncExitStack() as stack:

        async def open_(**settings: Any) -> InMemoryFleet:
            return await stack.enter_async_context(InMemoryFleet(WORLD_SIZES, **settings))

        yield open_


async def _store(fleet: InMemoryFleet) -> FleetStore:
    """The fleet's store, on a connection of the test's own."""
    return await FleetStore.open(fleet.server.connect("test-store"), fleet.config)  # type: ignore[arg-type]


async def _slow_loads(fleet: InMemoryFleet, worker_id: str, seconds: float) -> None:
    async def slow() -> None:
        await asyncio.sleep(seconds)

    fleet.engines[worker_id].on_load = slow


async def _until(check: Callable[[], bool], *, within_s: float = 60) -> None:
    async with asyncio.timeout(within_s):
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def _usurped_while_paused(
    fleet: InMemoryFleet, store: FleetStore
) -> tuple[UpdateResult, LeaderRecord]:
    """Ask for update ``u1``; once w1 is paused (its load is slow), write a
    successor's leader record over the leader's; the answer, and that record."""
    conn = fleet.server.connect("test-requester")
    inbox = conn.new_inbox()
    answers = await conn.subscribe(inbox)
    request = UpdateRequest(update_id="u1", adapter="policy", path="/adapters/policy/1")
    await conn.publish(fleet.subjects.update_request(), encode(request), reply=inbox)
    await _until(lambda: fleet.engines["w1"].paused)
    leader, revision = await store.read_leader()
    assert leader is not None
    usurper = LeaderRecord(holder="usurper", epoch=leader.epoch + 1)
    await store.write_leader(usurper, revision)
    answer = update_result_decoder.decode((await answers.next_msg(timeout=60)).data)
    return answer, usurper


async def test_a_leader_deposed_while_its_update_runs_records_nothing(
    open_fleet: OpenFleet,
) -> None:
    """Another coordinator took the leader record while the update loaded (the
    leader was frozen or cut off and had not renewed). The agents still obey
    the old epoch, so the update runs to its end; but the successor owns the
    store now: the deposed leader answers ``not_leader`` and writes neither a
    committed record nor a result over the successor's."""
    # A long lease: the leader does not look at its record again on its own
    # before the update ends, so only the check before committing can see it.
    fleet = await open_fleet(leader_lease_s=120)
    await _slow_loads(fleet, "w1", 2.0)
    store = await _store(fleet)

    answer, usurper = await _usurped_while_paused(fleet, store)

    assert answer.error is not None and answer.error.code == ErrorCode.NOT_LEADER, answer
    assert "deposed before committing" in answer.error.message
    assert (await store.read_leader())[0] == usurper, "the deposed leader wrote over its successor"
    assert await store.read_committed("policy") is None
    assert await store.read_result("u1") is None


async def test_a_leader_deposed_while_its_update_fails_answers_not_leader_and_steps_down(
    open_fleet: OpenFleet,
) -> None:
    """The same, but the update fails (as it does once the agents fence the
    deposed term off): that failure is this term's, not the fleet's outcome,
    so it is no answer; the requester asks again and the new leader answers.
    The deposed leader steps down at once instead of answering later requests
    until its next renewal."""
    fleet = await open_fleet(leader_lease_s=120)
    await _slow_loads(fleet, "w1", 2.0)
    fleet.engines["w1"].fail_load = True
    store = await _store(fleet)

    answer, _ = await _usurped_while_paused(fleet, store)
    # On looptime's clock: well before the 120 s lease's next renewal, which
    # would find the usurper too.
    await _until(lambda: not fleet.coordinator.leading.is_set(), within_s=5)

    assert answer.error is not None and answer.error.code == ErrorCode.NOT_LEADER, answer
    assert "ask again" in answer.error.message
    assert await store.read_result("u1") is None
    assert not any(engine.paused for engine in fleet.engines.values())


async def test_a_leader_cut_off_mid_update_is_succeeded_and_the_retry_is_answered(
    open_fleet: OpenFleet,
) -> None:
    """The leader's link goes silent while w1 loads (no socket closed, nothing
    reaches it or leaves it). The standby takes over once the lease lapses,
    fences the cut-off term and rolls its update back; the requester, which
    asks again with the same id while no answer comes, hears the roll-back;
    the engines end up running, and the next update commits under the new
    leader."""
    fleet = await open_fleet(leader_lease_s=2.0)
    standby = await fleet.start_coordinator("c2", leader_lease_s=2.0)
    await _slow_loads(fleet, "w1", 3.0)
    client = fleet.client()
    first = asyncio.ensure_future(
        client.update("policy", "/adapters/policy/1", version=1, update_id="u1", timeout_s=60)
    )
    await _until(lambda: fleet.engines["w1"].paused)
    fleet.connections["coordinator"].cut()

    answer = await first
    fleet.engines["w1"].on_load = None
    after = await client.update(
        "policy", "/adapters/policy/2", version=2, update_id="u2", timeout_s=60
    )

    assert standby.leading.is_set()
    assert answer.status == "failed" and answer.error is not None, answer
    assert answer.error.code == ErrorCode.FAILOVER, answer
    assert after.status == "committed", after
    assert not any(engine.paused for engine in fleet.engines.values())
    store = await _store(fleet)
    leader = (await store.read_leader())[0]
    assert leader is not None and leader.holder == "c2"


async def test_a_leader_frozen_before_its_commit_does_not_commit_over_the_roll_back(
    open_fleet: OpenFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader has every ack of ``u1`` and has seen itself lead once the
    update ran; then it is frozen (SIGSTOP: here its link goes silent, and
    its update and its lease renewals wait) past its lease. The standby
    takes over, marks the update as its own and rolls it back. The old
    leader wakes up with all its acks in hand, its update first (as it did
    in a chaos run): its claim of the commit finds the record taken over,
    so it commits nothing, and the requester, asking again, hears the
    roll-back. (Without the claim it stored a commit point for a version no
    engine serves any more.)"""
    fleet = await open_fleet(leader_lease_s=2.0)
    standby = await fleet.start_coordinator("c2", leader_lease_s=2.0)
    store = await _store(fleet)
    link = fleet.connections["coordinator"]
    real_still_leading, real_write_leader = Term.still_leading, FleetStore.write_leader
    frozen: list[FleetStore] = []
    renewals_thawed = asyncio.Event()

    async def still_leading_then_frozen(term: Term) -> bool:
        leading = await real_still_leading(term)
        if term.holder != "c1" or frozen:
            return leading
        frozen.append(term.store)
        link.cut()
        await _until(lambda: standby.leading.is_set())
        async with asyncio.timeout(60):
            while (await in_flight_of(store)) is not None:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        link.heal()
        return leading

    async def write_leader_unless_frozen(self: FleetStore, *args: Any) -> int:
        if self in frozen:
            await renewals_thawed.wait()
        return await real_write_leader(self, *args)

    monkeypatch.setattr(Term, "still_leading", still_leading_then_frozen)
    monkeypatch.setattr(FleetStore, "write_leader", write_leader_unless_frozen)
    try:
        answer = await fleet.client().update(
            "policy", "/adapters/policy/1", version=1, update_id="u1", timeout_s=60
        )
    finally:
        renewals_thawed.set()

    assert frozen, "the leader never reached its commit"
    assert answer.status == "failed" and answer.error is not None, answer
    assert answer.error.code == ErrorCode.FAILOVER, answer
    assert await store.read_committed("policy") is None
    assert await in_flight_of(store) is None
    assert not any("policy-v1" in engine.adapters for engine in fleet.engines.values())
    assert not any(engine.paused for engine in fleet.engines.values())
