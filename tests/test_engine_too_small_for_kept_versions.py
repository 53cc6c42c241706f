"""An engine that holds fewer adapters than the fleet keeps (SGLang with a
``--max-loaded-loras`` below the coordinator's ``--keep``) cannot serve every
version kept beside the committed one. Its agent does not push the committed
version out, again and again, to load a kept one: the kept version whose
load evicted it is left out (until the committed state changes), the
committed one goes back in, and the agent says what is missing and why.
Here the agents do not know the engine's capacity (an SGLang whose server
info does not show it): one that does refuses such an update before it
loads anything (test_capacity.py).
A real coordinator and real agents on a real nats-server, over simulated
SGLang workers that evict as SGLang does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from convergence_helpers import member_until
from engine_fleet import DEADLINE_S, StartFleet, engine_fleets

from lorabus.bus.connect import close, connect
from lorabus.schemas import Heartbeat, Subjects, heartbeat_decoder
from lorabus.simfleet import EngineSetup

ENGINES = {"w000": "sglang", "w001": "sglang"}


@pytest.fixture
async def start_fleet(nats_url: str, fleet_name: str, tmp_path: Path) -> AsyncIterator[StartFleet]:
    async with engine_fleets(nats_url, fleet_name, tmp_path) as start:
        yield start


async def test_a_kept_version_that_evicts_the_committed_one_is_left_out_and_named(
    start_fleet: StartFleet,
    make_adapter: Callable[[int], str],
    nats_url: str,
    fleet_name: str,
) -> None:
    client, sim = await start_fleet(
        ENGINES, {"w000": EngineSetup(max_loaded_loras=2, shows_max_loaded_loras=False)}, keep=3
    )
    tight = sim.workers["w000"]
    for version in (1, 2, 3):  # v3's load evicts v1, which is kept beside it
        assert (await client.update("policy", make_adapter(version), version=version)).committed

    shown = await member_until(
        client, "w000", lambda m: bool(m.unready_reason) and "policy-v3" in m.adapters
    )
    loads = tight.loads_received
    beats = await _next_beats("w000", 5, nats_url, fleet_name)

    reason = shown.unready_reason
    assert not shown.ready
    assert reason.startswith("missing policy-v2 (adapter policy): loading it failed once: "), reason
    assert "no longer lists the committed 'policy-v3'" in reason and "--max-loaded-loras" in reason
    assert all("policy-v3" in b.adapters and b.unready_reason == reason for b in beats), beats
    assert tight.loads_received == loads, "no load pushes the committed version out again"
    assert "policy-v3" in tight.adapters
    assert sorted(sim.workers["w001"].adapters) == ["policy-v1", "policy-v2", "policy-v3"]


async def _next_beats(
    worker_id: str, count: int, nats_url: str, fleet_name: str
) -> list[Heartbeat]:
    """The next ``count`` heartbeats of ``worker_id``."""
    nc = await connect(nats_url, name="test-beats")
    try:
        sub = await nc.subscribe(Subjects(fleet=fleet_name).heartbeat(worker_id))
        async with asyncio.timeout(DEADLINE_S):
            return [
                heartbeat_decoder.decode((await sub.next_msg(timeout=DEADLINE_S)).data)
                for _ in range(count)
            ]
    finally:
        await close(nc)
