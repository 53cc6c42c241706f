"""An operator's reset of an adapter (``lorabus reset``) removes its commit
point: agents stop requiring it at their next read of the fleet's KV, so a
worker that lost it, and cannot load it again, is ready once more. The real
agents and coordinator on the in-memory bus under looptime."""

from __future__ import annotations

import pytest
from convergence_helpers import PickyEngine, member_until
from memory_fleet import InMemoryFleet

from lorabus.operator import reset_committed

pytestmark = pytest.mark.looptime


async def test_a_reset_adapter_is_no_longer_required() -> None:
    fleet = InMemoryFleet({"w000": 1, "w001": 1})
    engine = fleet.engines["w001"] = PickyEngine()
    async with fleet:
        client = fleet.client()
        for adapter, version in (("policy", 1), ("other", 7)):
            assert (
                await client.update(adapter, f"/adapters/{adapter}/{version}", version=version)
            ).committed
        engine.refuse.add("other-v7")
        engine.adapters.remove("other-v7")
        missing = await member_until(
            client, "w001", lambda m: not m.ready and m.adapters == ["policy-v1"]
        )

        operator = fleet.server.connect("operator")
        reset = await reset_committed(operator, fleet.subjects, "other", "bogus")  # type: ignore[arg-type]
        fleet.connections["w001"].stats["reconnects"] += 1  # reads the fleet state again
        back = await member_until(client, "w001", lambda m: m.ready)
        ready = fleet.agents["w001"].ready

    assert reset.ok, reset.error
    assert not missing.ready
    assert ready and back.adapters == ["policy-v1"] and back.unready_reason == ""
    assert engine.adapters == ["policy-v1"], "nothing loaded, nothing unloaded"
