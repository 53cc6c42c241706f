"""What a new leader does with the update its predecessor left in flight, read
from a real JetStream KV written as the predecessor left it."""

from __future__ import annotations

from collections.abc import Callable

from lorabus.bus import close, connect
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.store import FleetStore
from lorabus.schemas import (
    CommittedRecord,
    InflightRecord,
    Phase,
    build_rank_map,
)
from lorabus.testbed.stack import EmbeddedStack

MEMBERS = {"w000": 1, "w001": 2}


async def _leave_in_flight(nats_url: str, fleet_name: str, *, committed: bool) -> None:
    """The store as a leader leaves it when it dies after its update's resume:
    the in-flight record, and the committed record if it got that far."""
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
            await store.write_committed(
                CommittedRecord(
                    adapter="policy",
                    version=7,
                    path="/adapters/policy-7",
                    served_name="policy-v7",
                    rank_map=build_rank_map(MEMBERS),
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
