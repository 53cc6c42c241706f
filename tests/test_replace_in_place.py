"""A version replaced under the same name (``--naming fixed``) on vLLM swaps the
weights in one call (``load_inplace``), so a new version that fails to load
leaves the old one serving instead of an engine without the name.

A real coordinator and real agents on a real nats-server, over simulated vLLM
workers that load in place as vLLM does (the new weights first, swapped in
only once they loaded); the same against a real vLLM, greedy tokens and all,
is in tests/real_vllm/test_vllm_updates.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from engine_fleet import StartFleet, engine_fleets

from lorabus.schemas import Naming

ENGINES = {"w000": "vllm", "w001": "vllm"}


@pytest.fixture
async def start_fleet(nats_url: str, fleet_name: str, tmp_path: Path) -> AsyncIterator[StartFleet]:
    async with engine_fleets(nats_url, fleet_name, tmp_path) as start:
        yield start


async def test_a_fixed_name_update_on_vllm_replaces_the_weights_in_place(
    start_fleet: StartFleet, make_adapter: Callable[[int], str]
) -> None:
    client, sim = await start_fleet(ENGINES, {}, naming=Naming.FIXED)
    assert (await client.update("policy", make_adapter(1), version=1)).committed
    for worker in sim.workers.values():
        worker.requests.clear()
    second = make_adapter(2)

    result = await client.update("policy", second, version=2)

    assert result.committed, result.error
    for worker in sim.workers.values():
        writes = [(r.method, r.path, r.body) for r in worker.requests if r.method == "POST"]
        loads = [body for _, path, body in writes if path == "/v1/load_lora_adapter"]
        assert loads == [{"lora_name": "policy", "lora_path": second, "load_inplace": True}]
        assert not [path for _, path, _ in writes if path == "/v1/unload_lora_adapter"]
        assert worker.adapter_paths == {"policy": second}


async def test_a_new_version_that_fails_to_load_leaves_the_old_one_serving(
    start_fleet: StartFleet, make_adapter: Callable[[int], str]
) -> None:
    client, sim = await start_fleet(ENGINES, {}, naming=Naming.FIXED)
    first = make_adapter(1)
    assert (await client.update("policy", first, version=1)).committed
    # A 4xx: final (a 5xx is tried again within the budget, and would succeed).
    sim.workers["w000"].set_faults(fail_next_loads=1, load_failure_status=400)

    result = await client.update("policy", make_adapter(2), version=2)

    assert result.status == "failed", result
    assert result.workers["w000"].error is not None, result.workers
    failed = sim.workers["w000"]
    assert failed.adapter_paths == {"policy": first}, "the old version stopped serving"
    assert not failed.paused
    status = await client.status()
    assert status.committed_adapter == "policy" and status.committed_version == 1, status


async def test_a_fixed_name_on_sglang_is_unloaded_while_generation_runs_not_while_frozen(
    start_fleet: StartFleet, make_adapter: Callable[[int], str]
) -> None:
    """SGLang's unload waits for the requests running on the adapter, and its
    in_place pause freezes them: an unload inside the pause would wait until
    the phase's budget ran out. The agent lets generation continue for the
    unload, pauses again, then loads; the update commits and nothing is
    left paused."""
    client, sim = await start_fleet({"w000": "sglang", "w001": "sglang"}, {}, naming=Naming.FIXED)
    assert (await client.update("policy", make_adapter(1), version=1)).committed
    busy = sim.workers["w000"]
    busy.set_faults(busy_loras=["policy"])  # requests running on it, frozen by the pause
    busy.requests.clear()
    second = make_adapter(2)

    result = await client.update("policy", second, version=2)

    assert result.committed, result.error
    calls = [r.path for r in busy.requests if r.method == "POST"]
    assert calls == [
        "/pause_generation",
        "/continue_generation",
        "/unload_lora_adapter",
        "/pause_generation",
        "/load_lora_adapter",
        "/flush_cache",  # the same name, new weights: no prefix of the old ones
        "/continue_generation",
        "/generate",  # the canary, after the resume
    ], calls
    assert busy.adapter_paths == {"policy": second}
    assert not any(worker.paused for worker in sim.workers.values())
