"""A coordinator of wire version 6 sends committed notices that name no
adapter and nothing kept: an agent of version 7 still converges on every
adapter it heard of, placing each notice by its served name. The real agents
and coordinator on the in-memory bus under looptime; the coordinator's own
notices are lost on their way to w001, which hears each again as a
version-6 coordinator would say it."""

from __future__ import annotations

import asyncio

import pytest
from convergence_helpers import PickyEngine, lose_notices, member_until
from memory_fleet import InMemoryFleet

from lorabus.schemas import CommittedNotice, UpdateResult, encode

pytestmark = pytest.mark.looptime
V6 = "v6-"


async def _commit(fleet: InMemoryFleet, adapter: str, version: int) -> None:
    """Commit ``adapter`` v``version``, and tell w001 as version 6 would."""
    path = f"/adapters/{adapter}/{version}"
    result: UpdateResult = await fleet.client().update(adapter, path, version=version)
    assert result.committed, result.error
    notice = CommittedNotice(
        update_id=f"{V6}{result.update_id}",
        budget_s=0,
        epoch=fleet.coordinator.epoch,
        served_name=result.adapter,
        path=path,
        version=version,
        digest=result.digest,
        v=6,
    )
    await fleet.server.connect("v6").publish(fleet.subjects.cmd(), encode(notice))


async def test_version_6_notices_still_converge_on_every_adapter() -> None:
    fleet = InMemoryFleet({"w000": 1, "w001": 1})
    engine = fleet.engines["w001"] = PickyEngine()
    async with fleet:
        lose_notices(fleet, "w001", but=V6)
        client = fleet.client()
        await _commit(fleet, "policy", 1)
        await _commit(fleet, "other", 7)
        release = engine.hold["policy-v1"] = asyncio.Event()
        engine.adapters.clear()

        waiting = await member_until(client, "w001", lambda m: m.adapters == ["other-v7"])
        release.set()
        back = await member_until(client, "w001", lambda m: m.ready)

        await _commit(fleet, "policy", 2)
        engine.adapters.clear()
        again = await member_until(client, "w001", lambda m: m.ready and "policy-v2" in m.adapters)

    assert not waiting.ready, "policy-v1 is still to come"
    assert sorted(back.adapters) == ["other-v7", "policy-v1"]
    assert {"other-v7", "policy-v2"} <= set(again.adapters), again
