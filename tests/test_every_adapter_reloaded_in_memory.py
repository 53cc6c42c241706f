"""An agent serves every adapter the fleet has committed, and the versions kept
beside each, not only the newest commit (issue 40): a worker that lost its
adapters (its agent restarted, its engine restarted) loads all of them again,
and is not ready until it has. The real agents and the real coordinator on
the in-memory bus (memory_fleet.py) under looptime's fake clock; against a
real nats-server, with adapters from the object store, in
test_every_adapter_reloaded.py."""

from __future__ import annotations

import asyncio

import pytest
from convergence_helpers import DEADLINE_S, PickyEngine, lose_notices, member_until
from memory_fleet import InMemoryFleet

pytestmark = pytest.mark.looptime


def _fleet() -> tuple[InMemoryFleet, PickyEngine]:
    fleet = InMemoryFleet({"w000": 1, "w001": 1})
    engine = fleet.engines["w001"] = PickyEngine()
    return fleet, engine


async def _commit_two_adapters(fleet: InMemoryFleet) -> None:
    client = fleet.client()
    for adapter, version in (("policy", 1), ("other", 7)):
        result = await client.update(adapter, f"/adapters/{adapter}/{version}", version=version)
        assert result.committed, result.error


async def test_a_restarted_agent_on_an_empty_engine_loads_every_adapter_before_it_is_ready() -> (
    None
):
    """The issue's scenario: ``policy`` v1, then ``other`` v7; w001's agent
    restarts, and its engine lost its adapters. Before, it served
    ``other-v7`` only and said it was ready."""
    fleet, engine = _fleet()
    async with fleet:
        await _commit_two_adapters(fleet)
        await fleet.kill_agent("w001")
        engine.adapters.clear()

        agent = await fleet.start_agent("w001", 1)
        held_when_ready = sorted(engine.adapters)
        ready = agent.ready
        # The coordinator counts it again, with both.
        result = await fleet.client().update("policy", "/adapters/policy/2", version=2)

    assert held_when_ready == ["other-v7", "policy-v1"]
    assert ready
    assert engine.loaded[-3:] == ["other-v7", "policy-v1", "policy-v2"], (
        "by adapter, then the update"
    )
    assert result.committed and sorted(result.workers) == ["w000", "w001"], result


async def test_an_engine_that_lost_every_adapter_is_not_ready_until_it_has_them_all() -> None:
    fleet, engine = _fleet()
    async with fleet:
        await _commit_two_adapters(fleet)
        client = fleet.client()
        release = engine.hold["policy-v1"] = asyncio.Event()
        engine.adapters.clear()  # as an engine restart would

        # other-v7 is back; policy-v1's load is held: not ready, yet converging.
        waiting = await member_until(
            client, "w001", lambda m: m.adapters == ["other-v7"] and not m.ready
        )
        agent_ready = fleet.agents["w001"].ready
        release.set()
        back = await member_until(client, "w001", lambda m: m.ready)

    assert waiting.unready_reason == "", "it converges on its own: no reason to give up on it"
    assert waiting.missing == ["policy-v1"], "it says what its engine lacks meanwhile"
    assert not agent_ready
    assert sorted(back.adapters) == ["other-v7", "policy-v1"]


async def test_an_adapter_that_keeps_failing_to_load_is_named_as_missing() -> None:
    fleet, engine = _fleet()
    async with fleet:
        await _commit_two_adapters(fleet)
        client = fleet.client()
        engine.refuse.add("policy-v1")
        engine.adapters.clear()

        stuck = await member_until(client, "w001", lambda m: bool(m.unready_reason))
        engine.refuse.clear()
        back = await member_until(client, "w001", lambda m: m.ready)

    assert not stuck.ready and stuck.adapters == ["other-v7"], stuck
    assert stuck.unready_reason.startswith(
        "missing policy-v1 (adapter policy): loading it failed 3 times: no adapter at"
    ), stuck.unready_reason
    assert back.unready_reason == "" and sorted(back.adapters) == ["other-v7", "policy-v1"]


@pytest.mark.parametrize("learnt_from", ["notice", "read after a reconnect"])
async def test_a_kept_version_the_engine_lost_is_loaded_again(learnt_from: str) -> None:
    """``policy`` v1 is kept beside v2 (the coordinator's ``--keep`` 2): an
    engine that lost it loads it again, whether its agent learnt that from
    the commit's notice or, every notice lost, from its read of the fleet's
    KV after a reconnect."""
    fleet, engine = _fleet()
    async with fleet:
        if learnt_from != "notice":
            lose_notices(fleet, "w001")
        client = fleet.client()
        for version in (1, 2):
            assert (
                await client.update("policy", f"/adapters/policy/{version}", version=version)
            ).committed
        engine.adapters.remove("policy-v1")
        loaded_before = len(engine.loaded)
        if learnt_from != "notice":
            fleet.connections["w001"].stats["reconnects"] += 1

        async with asyncio.timeout(DEADLINE_S):
            while "policy-v1" not in engine.loaded[loaded_before:]:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        ready = fleet.agents["w001"].ready
        others = fleet.engines["w000"].calls.count("load")

    assert ready
    assert sorted(engine.adapters) == ["policy-v1", "policy-v2"]
    assert engine.loaded[loaded_before:] == ["policy-v1"]
    assert others == 2, "w000 lost nothing, and loads nothing"
