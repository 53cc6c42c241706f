"""Agents converge to the committed adapter before they count as ready: the
real agents and the real coordinator on the in-memory bus
(``memory_fleet.py``) under looptime's fake clock, where an engine loses its
adapters (as a restart would) or cannot load them again. What needs real
adapter directories, or a hand-driven coordinator, is tested against a real
nats-server in test_reconciliation.py."""

from __future__ import annotations

import asyncio

import pytest
from memory_fleet import InMemoryFleet, MemoryEngine

from lorabus.schemas import PauseCommand

pytestmark = pytest.mark.looptime

DEADLINE_S = 15.0


def _adapter(step: int) -> str:
    return f"/adapters/policy/step_{step}"


async def _unready_w001(fleet: InMemoryFleet) -> MemoryEngine:
    """Make w001's engine lose the committed adapter for good, and wait until
    the coordinator shows w001 as not ready."""
    broken = fleet.engines["w001"]
    broken.adapters.remove("policy-v1")
    broken.fail_load = True  # it cannot reconcile
    client = fleet.client()

    async def not_ready() -> None:
        while True:
            status = await client.status()
            if any(m.worker_id == "w001" and not m.ready for m in status.members):
                return
            await asyncio.sleep(0.05)

    await asyncio.wait_for(not_ready(), DEADLINE_S)
    return broken


async def test_a_new_agent_loads_the_committed_adapter_before_it_is_ready() -> None:
    async with InMemoryFleet({"w000": 1, "w001": 1}) as fleet:
        committed = await fleet.client().update("policy", _adapter(1), version=1)
        assert committed.committed, committed.error

        agent = await fleet.start_agent("late", 2)
        loaded_when_ready = set(fleet.engines["late"].adapters)

    assert agent.ready
    assert loaded_when_ready == {"policy-v1"}


async def test_an_engine_that_lost_its_adapters_gets_the_committed_one_back() -> None:
    async with InMemoryFleet({"w000": 1, "w001": 1}) as fleet:
        assert (await fleet.client().update("policy", _adapter(1), version=1)).committed
        engine = fleet.engines["w001"]
        engine.adapters.remove("policy-v1")  # as an engine restart would

        async with asyncio.timeout(DEADLINE_S):
            while "policy-v1" not in engine.adapters:  # noqa: ASYNC110
                await asyncio.sleep(0.05)

    assert "policy-v1" in engine.adapters


async def test_an_update_does_not_count_an_agent_that_is_not_ready() -> None:
    async with InMemoryFleet({"w000": 1, "w001": 1}, quorum_timeout_s=1.0) as fleet:
        client = fleet.client()
        assert (await client.update("policy", _adapter(1), version=1)).committed
        await _unready_w001(fleet)
        result = await client.update("policy", _adapter(2), version=2)

    assert result.error is not None and result.error.code == "quorum_timeout"


async def test_the_broadcast_pause_leaves_out_a_member_that_is_not_ready() -> None:
    """After a term's first update the pause is one broadcast: a live member
    the update does not count (it cannot reconcile) is excluded by name, so
    its engine is not paused."""
    async with InMemoryFleet({"w000": 1, "w001": 1}, quorum=0.5, quorum_timeout_s=5.0) as fleet:
        client = fleet.client()
        assert (await client.update("policy", _adapter(1), version=1)).committed
        broken = await _unready_w001(fleet)
        calls_before = len(broken.calls)
        result = await client.update("policy", _adapter(2), version=2)
        calls = broken.calls[calls_before:]
        pauses = [
            c
            for subject, c in fleet.commands
            if subject == fleet.subjects.cmd() and isinstance(c, PauseCommand)
        ]

    assert result.committed, result.error
    assert sorted(result.workers) == ["w000"]
    assert [(p.update_id, p.excluded) for p in pauses] == [(result.update_id, ["w001"])]
    assert "policy-v2" in fleet.engines["w000"].adapters
    assert "pause" not in calls, calls
