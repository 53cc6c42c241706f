"""What a new leader does with the update its predecessor left in flight, read
from a real JetStream KV written as the predecessor left it; and what a leader
does when a write for a successor fails."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NatsClient
from store_helpers import in_flight_of

from lorabus.bus.connect import close, connect
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.service import Coordinator
from lorabus.coordinator.signals import StoreUnavailable
from lorabus.coordinator.store import FleetStore
from lorabus.operator import reset_committed
from lorabus.schemas import (
    CommittedRecord,
    ErrorCode,
    InflightRecord,
    Phase,
    Subjects,
    UpdateResult,
    build_rank_map,
)
from lorabus.testbed.stack import EmbeddedStack

MEMBERS = {"w000": 1, "w001": 2}
COMMITTED_7 = CommittedRecord(
    adapter="policy",
    version=7,
    path="/adapters/policy-7",
    served_name="policy-v7",
    rank_map=build_rank_map(MEMBERS),
)


async def _leave_in_flight(
    nats_url: str,
    fleet_name: str,
    *,
    committed: bool,
    latest: bool = True,
    result: bool = False,
    record: CommittedRecord = COMMITTED_7,
) -> None:
    """The store as a leader leaves it when it dies after its update's resume:
    the in-flight record, and the committed ``record`` if it got that far (with
    ``latest`` False, its commit point only: it died writing the rest, before
    its answer; ``result``: and its result had landed)."""
    nc = await connect(nats_url, name="test-predecessor")
    try:
        config = CoordinatorConfig(
            fleet=fleet_name, frontend_url="http://frontend.invalid", expected_world_size=1
        )
        store = await FleetStore.open(nc, config)
        await store.write_inflight(
            InflightRecord(
                update_id="step-7",
                epoch=1,
                phase=Phase.LOAD,
                adapter="policy",
                served_name="policy-v7",
                version=7,
                members=MEMBERS,
            )
        )
        if committed:
            await (store.write_committed if latest else store.commit)(record)
        if result:
            await store.write_result(
                UpdateResult(
                    update_id="step-7",
                    status="committed",
                    adapter="policy-v7",
                    version=7,
                    rank_map=COMMITTED_7.rank_map,
                )
            )
    finally:
        await close(nc)


async def test_an_update_that_committed_before_its_leader_died_stays_committed(
    nats_url: str,
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    await _leave_in_flight(nats_url, fleet_name, committed=True)
    async with make_stack(list(MEMBERS.values())) as stack:
        assert stack.client is not None and stack.sim is not None
        answer = await stack.client.update(
            "policy", "/adapters/policy-7", version=7, update_id="step-7"
        )
        requests = [r for w in stack.sim.workers.values() for r in w.requests]
        unloads = [r for r in requests if r.method == "DELETE"]

    assert answer.committed, answer.error
    assert answer.rank_map == build_rank_map(MEMBERS)
    assert not unloads, "a committed version must not be withdrawn"


@pytest.mark.parametrize("result_landed", [False, True], ids=["nothing", "the result"])
async def test_a_commit_whose_leader_died_before_answering_is_recorded_in_full(
    result_landed: bool,
    nats_url: str,
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    """A leader writes a commit's commit point, then its result and the
    fleet's latest record together, and answers after: dying before either
    (or both) landed, it leaves them to its successor, which writes them
    from the commit point and answers the requester's retry committed."""
    await _leave_in_flight(nats_url, fleet_name, committed=True, latest=False, result=result_landed)
    async with make_stack(list(MEMBERS.values())) as stack:
        assert stack.client is not None
        answer = await stack.client.update(
            "policy", "/adapters/policy-7", version=7, update_id="step-7"
        )
        async with _reading(nats_url, fleet_name) as store:
            latest = await store.read_committed()
            recorded = await store.read_result("step-7")
            in_flight = await in_flight_of(store)

    assert answer.committed, answer.error
    assert latest == COMMITTED_7, latest
    assert recorded is not None and recorded.committed, recorded
    assert in_flight is None, in_flight


@pytest.mark.parametrize(
    ("method", "commits"),
    [("swap_inflight", False), ("commit", True), ("write_result", True)],
    ids=["the claim", "the commit point", "the result"],
)
async def test_a_commit_the_store_refuses_for_a_lease_is_left_to_the_next_term(
    method: str,
    commits: bool,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A write of the commit fails for a whole lease, in the first term only.
    That term answers nothing but ``not_leader``: it steps aside with the
    update in flight, and whoever leads next (here the same coordinator, two
    leases later) finishes the commit from its claim or its commit point,
    or, without either (the claim is what failed), rolls it back. The
    requester asks again and gets that outcome, so no requester is ever told
    "committed" of a commit the store lacks."""
    stacks: list[EmbeddedStack] = []

    def in_the_first_term(*_: object) -> bool:
        return (
            bool(stacks)
            and stacks[0].coordinator is not None
            and (stacks[0].coordinator.epoch == 1)
        )

    failing = _TimesOut(monkeypatch, method, 1000, in_the_first_term)
    async with make_stack([1, 1], leader_lease_s=1.0) as stack:
        stacks.append(stack)
        assert stack.client is not None and stack.sim is not None
        answer = await stack.client.update(
            "policy", make_adapter(1), version=1, update_id="step-1", timeout_s=60
        )
        async with _reading(nats_url, fleet_name) as store:
            recorded = await store.read_result("step-1")
            own = await store.read_committed("policy")
            in_flight = await in_flight_of(store)
            leader = (await store.read_leader())[0]
        held = {w.worker_id: list(w.adapters) for w in stack.sim.workers.values()}
        paused = [w.worker_id for w in stack.sim.workers.values() if w.paused]

    assert failing.left < 1000, "the write never failed"
    assert leader is not None and leader.epoch == 2, leader
    assert recorded is not None and recorded == answer, (recorded, answer)
    assert in_flight is None, in_flight
    assert not paused, paused
    if commits:
        assert answer.committed, answer.error
        assert own is not None and own.served_name == "policy-v1", own
        assert all("policy-v1" in adapters for adapters in held.values()), held
    else:
        assert answer.error is not None and answer.error.code == ErrorCode.FAILOVER, answer
        assert own is None, own
        assert not any("policy-v1" in adapters for adapters in held.values()), held


async def test_a_commit_point_that_cannot_be_read_at_first_is_read_again_not_rolled_back(
    nats_url: str,
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The successor's first reads of the commit point fail as a read that
    timed out does. Read as "no commit point", the update its requester was
    told committed would be rolled back; it is read again instead, and the
    commit stands."""
    await _leave_in_flight(nats_url, fleet_name, committed=True, latest=False)
    failing = _TimesOut(monkeypatch, "read_committed", 2, lambda adapter=None: adapter == "policy")
    async with make_stack(list(MEMBERS.values())) as stack:
        assert stack.client is not None and stack.sim is not None
        answer = await stack.client.update(
            "policy", "/adapters/policy-7", version=7, update_id="step-7"
        )
        requests = [r for w in stack.sim.workers.values() for r in w.requests]
        async with _reading(nats_url, fleet_name) as store:
            recorded = await store.read_result("step-7")
            latest = await store.read_committed()

    assert failing.left == 0, "the commit point was never read while it failed"
    assert answer.committed, answer.error
    assert not [r for r in requests if r.method == "DELETE"], "a committed version was withdrawn"
    assert recorded is not None and recorded.committed, recorded
    assert latest == COMMITTED_7, latest


async def test_a_commit_is_answered_once_a_result_that_failed_at_first_is_stored(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A commit's result is written before its answer; when that write fails,
    it is tried again, and the answer waits for it: once the requester hears
    "committed", the result is stored and the update no longer in flight, so
    the next update has nothing to wait for."""
    failing = _TimesOut(monkeypatch, "write_result", 2, lambda r: r.update_id == "step-1")
    async with make_stack([1, 1]) as stack:
        assert stack.client is not None
        first = await stack.client.update("policy", make_adapter(1), version=1, update_id="step-1")
        async with _reading(nats_url, fleet_name) as store:
            recorded = await store.read_result("step-1")
            left = await in_flight_of(store)
            second = await stack.client.update(
                "policy", make_adapter(2), version=2, update_id="step-2"
            )

    assert failing.left == 0
    assert first.committed and second.committed, (first.error, second.error)
    assert recorded is not None and recorded.committed and recorded.version == 1, recorded
    assert left is None, left


async def test_a_leader_that_cannot_read_what_was_left_gives_the_fleet_to_a_standby(
    nats_url: str, fleet_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Coordinator a cannot read the update its predecessor left in flight
    (every read times out, on its connection alone). After a lease of failed
    reads it steps aside, and b, standing by, takes the lease instead of a
    taking it back at once: b reads the record and rolls the update back."""
    await _leave_in_flight(nats_url, fleet_name, committed=False)
    nc_a = await connect(nats_url, name="test-coordinator-a")
    nc_b = await connect(nats_url, name="test-coordinator-b")
    blind: set[int] = set()
    opening, reading = FleetStore.open.__func__, FleetStore.read_inflight_entry  # type: ignore[attr-defined]

    async def open_(
        cls: type[FleetStore], nc: NatsClient, config: Any, signer: Any = None
    ) -> FleetStore:
        store = await opening(cls, nc, config, signer)
        if nc is nc_a:
            blind.add(id(store))
        return store

    async def read_inflight_entry(store: FleetStore, key: str) -> tuple[InflightRecord | None, int]:
        if id(store) in blind:
            raise StoreUnavailable("read_inflight: TimeoutError()")
        return await reading(store, key)

    monkeypatch.setattr(FleetStore, "open", classmethod(open_))
    monkeypatch.setattr(FleetStore, "read_inflight_entry", read_inflight_entry)

    def coordinator(holder: str) -> Coordinator:
        return Coordinator(
            CoordinatorConfig(
                fleet=fleet_name,
                frontend_url="http://127.0.0.1:9",
                expected_world_size=3,
                leader_lease_s=1.0,
                phase_timeout_s=1.0,
                holder=holder,
            )
        )

    serving: list[asyncio.Task[None]] = []
    try:
        store = await _store_of(nc_b, fleet_name)
        serving.append(asyncio.create_task(coordinator("a").run(nc_a)))
        async with asyncio.timeout(10):
            while (leader := (await store.read_leader())[0]) is None:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert leader.holder == "a"
        serving.append(asyncio.create_task(coordinator("b").run(nc_b)))
        async with asyncio.timeout(30):
            while await in_flight_of(store) is not None:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        leader = (await store.read_leader())[0]
        rolled_back = await store.read_result("step-7")
    finally:
        for task in serving:
            task.cancel()
        await asyncio.gather(*serving, return_exceptions=True)
        await close(nc_a)
        await close(nc_b)

    assert leader is not None and leader.holder == "b", leader
    assert rolled_back is not None and not rolled_back.committed, rolled_back


async def test_a_recovered_commit_whose_result_failed_at_first_is_stored_before_serving(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The predecessor died after its commit point; the successor's first
    write of the result fails. It is tried again before the successor serves
    anything: its own next update would replace the in-flight record the
    result is rebuilt from."""
    # At a real path, so that the agents load it and the next update can run.
    record = msgspec.structs.replace(COMMITTED_7, path=make_adapter(7))
    await _leave_in_flight(nats_url, fleet_name, committed=True, latest=False, record=record)
    failing = _TimesOut(monkeypatch, "write_result", 1, lambda r: r.update_id == "step-7")
    async with make_stack(list(MEMBERS.values())) as stack:
        assert stack.client is not None
        await stack.client.status(timeout_s=5)  # answered once recovery is done
        async with _reading(nats_url, fleet_name) as store:
            recorded = await store.read_result("step-7")
            left = await in_flight_of(store)
            later = await stack.client.update(
                "policy", make_adapter(8), version=8, update_id="step-8"
            )

    assert failing.left == 0
    assert recorded is not None and recorded.committed and recorded.version == 7, recorded
    assert left is None, left
    assert later.committed, later.error


async def test_a_reset_after_a_commit_whose_latest_record_failed_is_not_undone(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The latest record of a commit failed at first, then an operator reset
    the adapter: the write is made again before the commit is answered and
    the reset runs, not after it, where it would bring back the record the
    reset removed (and agents that reconnect would load it)."""
    failing = _TimesOut(monkeypatch, "write_latest", 1, lambda _record: True)
    async with make_stack([1, 1]) as stack:
        assert stack.client is not None
        first = await stack.client.update("policy", make_adapter(1), version=1, update_id="step-1")
        nc = await connect(nats_url, name="test-operator")
        try:
            await failing.tried()  # before the answer
            reset = await reset_committed(nc, Subjects(fleet=fleet_name), "policy", "bogus step")
            # This one fails (no adapter at its path), so it writes no latest
            # record of its own.
            later = await stack.client.update(
                "policy", make_adapter(2) + "-missing", version=2, update_id="step-2"
            )
            store = await _store_of(nc, fleet_name)
            latest = await store.read_committed()
            own = await store.read_committed("policy")
        finally:
            await close(nc)

    assert first.committed, first.error
    assert reset.ok, reset.error
    assert not later.committed, later
    assert latest is None and own is None, (latest, own)


async def test_a_state_record_that_does_not_decode_is_neither_obeyed_nor_fatal(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A record in the fleet's bucket that does not decode (only a coordinator
    or the operator can write there) is not read as an update it could record
    or withdraw: the new leader says why, resumes every member and removes it,
    and leads without anybody's help (test_corrupt_state.py has the others)."""
    nc = await connect(nats_url, name="test-operator")
    try:
        store = await _store_of(nc, fleet_name)
        state = await nc.jetstream().key_value(Subjects(fleet=fleet_name).state_bucket())
        await state.put("inflight", b'{"update_id": ')
        async with make_stack(list(MEMBERS.values())) as stack:
            assert stack.client is not None and stack.coordinator is not None
            answer = await stack.client.update("policy", make_adapter(7), version=7)
            left = await in_flight_of(store)  # decodes: the garbage is gone
    finally:
        await close(nc)

    assert "inflight holds a record that does not decode" in caplog.text
    assert left is None or left.update_id == answer.update_id, left
    assert answer.committed, answer.error


async def test_a_later_commit_stays_the_latest_record(
    nats_url: str,
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    """An update left in flight after everything of its commit landed (only
    the removal of its record failed) and a later commit of another adapter:
    the successor keeps the later commit as the fleet's latest record."""
    await _leave_in_flight(nats_url, fleet_name, committed=True, result=True)
    later = msgspec.structs.replace(
        COMMITTED_7, adapter="critic", served_name="critic-v1", version=1, path="/adapters/c-1"
    )
    nc = await connect(nats_url, name="test-later-commit")
    try:
        await (await _store_of(nc, fleet_name)).write_committed(later)
    finally:
        await close(nc)
    async with make_stack(list(MEMBERS.values())) as stack:
        assert stack.client is not None
        answer = await stack.client.update(
            "policy", "/adapters/policy-7", version=7, update_id="step-7"
        )
        status = await stack.client.status(timeout_s=5)
        async with _reading(nats_url, fleet_name) as store:
            latest = await store.read_committed()
            in_flight = await in_flight_of(store)

    assert answer.committed, answer.error
    assert latest == later, latest
    assert status.committed_adapter == "critic-v1", status
    assert in_flight is None, in_flight


async def test_a_request_answered_already_committed_while_it_waited_is_stored(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    """A second update id for the version another id is committing waits
    behind it, then is answered "already committed" without running: that
    answer has no commit point to be rebuilt from, so the coordinator must
    store it itself (before it goes out), for a requester that asks a new
    leader again. What this checks is that it is stored at all."""
    async with make_stack([1, 1]) as stack:
        assert stack.client is not None and stack.sim is not None
        stack.sim.workers["w000"].set_faults(latency_s={"load": 0.5})
        path = make_adapter(7)
        first = asyncio.create_task(
            stack.client.update("policy", path, version=7, update_id="step-7")
        )
        await _until_running(stack, "step-7")
        second = await stack.client.update("policy", path, version=7, update_id="step-7b")
        assert (await first).committed
        nc = await connect(nats_url, name="test-reader")
        try:
            recorded = await (await _store_of(nc, fleet_name)).read_result("step-7b")
        finally:
            await close(nc)

    assert second.committed, second.error
    assert recorded is not None and recorded.committed, recorded


async def test_an_update_that_had_not_committed_is_rolled_back(
    nats_url: str,
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    await _leave_in_flight(nats_url, fleet_name, committed=False)
    async with make_stack(list(MEMBERS.values())) as stack:
        assert stack.client is not None
        answer = await stack.client.update(
            "policy", "/adapters/policy-7", version=7, update_id="step-7"
        )

    assert answer.status == "failed"
    assert answer.error is not None and answer.error.code == "failover"


async def _until_running(stack: EmbeddedStack, update_id: str) -> None:
    assert stack.client is not None
    async with asyncio.timeout(10):
        while (await stack.client.status(timeout_s=5)).in_flight != update_id:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


class _TimesOut:
    """Makes a :class:`FleetStore` method raise what a call that timed out
    raises, ``times`` times, for the calls ``when`` picks. A real server
    cannot fail one key alone (every read or write of a bucket goes to one
    JetStream API subject), nor one write of several in flight."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        method: str,
        times: int,
        when: Callable[..., bool],
    ) -> None:
        self.left = times
        real = getattr(FleetStore, method)

        async def timing_out(store: FleetStore, *args: Any) -> Any:
            if self.left and when(*args):
                self.left -= 1
                raise StoreUnavailable(f"{method}: TimeoutError()")
            return await real(store, *args)

        monkeypatch.setattr(FleetStore, method, timing_out)

    async def tried(self) -> None:
        """Until every failure has been raised."""
        async with asyncio.timeout(10):
            while self.left:  # noqa: ASYNC110
                await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _reading(nats_url: str, fleet: str) -> AsyncIterator[FleetStore]:
    """The fleet's store, on a connection of the test's own."""
    nc = await connect(nats_url, name="test-reader")
    try:
        yield await _store_of(nc, fleet)
    finally:
        await close(nc)


async def _store_of(nc: NatsClient, fleet: str) -> FleetStore:
    return await FleetStore.open(
        nc,
        CoordinatorConfig(
            fleet=fleet, frontend_url="http://frontend.invalid", expected_world_size=2
        ),
    )
