"""An engine that drops the committed adapter to make room never does so unnoticed.

SGLang with ``--max-loaded-loras`` answers a load that makes one adapter too
many with success, after unloading the least recently used other one, which
can be the committed version. The load of an update that did that fails,
saying so; the agent, whose read-back no longer shows the committed
adapter, is not ready until it has loaded it again, which it does on its own.
An eviction of a version the fleet no longer serves is no failure.

Here the agents do not know the engine's capacity (an SGLang whose server
info does not show it): one that does refuses such an update before it
loads anything (test_capacity.py).

A real coordinator and real agents on a real nats-server, over simulated
SGLang workers that evict as SGLang does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from convergence_helpers import member_until
from engine_fleet import StartFleet, engine_fleets

from lorabus.schemas import ErrorCode
from lorabus.simfleet import EngineSetup

ENGINES = {"w000": "sglang", "w001": "sglang"}


@pytest.fixture
async def start_fleet(nats_url: str, fleet_name: str, tmp_path: Path) -> AsyncIterator[StartFleet]:
    async with engine_fleets(nats_url, fleet_name, tmp_path) as start:
        yield start


async def test_a_load_that_evicts_the_committed_version_fails_and_the_agent_reloads_it(
    start_fleet: StartFleet, make_adapter: Callable[[int], str]
) -> None:
    client, sim = await start_fleet(
        ENGINES, {"w000": EngineSetup(max_loaded_loras=1, shows_max_loaded_loras=False)}
    )
    tight = sim.workers["w000"]
    assert (await client.update("policy", make_adapter(1), version=1)).committed
    reloads_before = tight.loads_received

    result = await client.update("policy", make_adapter(2), version=2)

    assert result.status == "failed"
    assert result.error is not None and "w000" in result.error.message, result.error
    error = result.workers["w000"].error
    assert error is not None and error.code == ErrorCode.ENGINE_ERROR, error
    assert "no longer lists the committed 'policy-v1'" in error.message, error
    assert "--max-loaded-loras" in error.message, error
    assert result.workers["w001"].ok
    # The agent puts the committed version back on its own, and says it is
    # ready only once the engine has it again.
    back = await member_until(client, "w000", lambda m: m.adapters == ["policy-v1"])
    assert back.ready, back
    assert list(tight.adapters) == ["policy-v1"] and not tight.paused
    assert tight.loads_received == reloads_before + 2  # the update's load, then the reload
    status = await client.status()
    assert status.committed_adapter == "policy-v1"
    assert all(w.adapters.keys() == {"policy-v1"} for w in sim.workers.values())


async def test_an_eviction_of_a_version_the_fleet_no_longer_serves_is_no_failure(
    start_fleet: StartFleet, make_adapter: Callable[[int], str]
) -> None:
    # Room for two: the third version's load evicts the first, not the committed second.
    client, sim = await start_fleet(
        ENGINES, {"w000": EngineSetup(max_loaded_loras=2, shows_max_loaded_loras=False)}, keep=2
    )
    for version in (1, 2):
        assert (await client.update("policy", make_adapter(version), version=version)).committed

    result = await client.update("policy", make_adapter(3), version=3)

    assert result.committed, result.error
    # Until the agent has the commit's notice it still counts v1 as kept (the
    # canary runs between the load and the commit): it then settles, ready.
    shown = await member_until(client, "w000", lambda m: "policy-v1" not in m.adapters and m.ready)
    assert "policy-v3" in shown.adapters and "policy-v2" in shown.adapters, shown
    assert sorted(sim.workers["w000"].adapters) == ["policy-v2", "policy-v3"]
