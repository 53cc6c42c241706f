"""An update's outcome by its id alone (``lorabus result``): what the
coordinator knows of it, without running anything."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import pytest
from processes import run_lorabus

from lorabus.schemas import COMMITTED, PENDING, UNKNOWN
from lorabus.testbed.stack import EmbeddedStack


@pytest.fixture
async def stack(make_stack: Callable[..., EmbeddedStack]) -> AsyncIterator[EmbeddedStack]:
    async with make_stack([1, 1]) as started:
        yield started


async def test_an_id_is_unknown_then_pending_then_its_result(
    stack: EmbeddedStack, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None and stack.sim is not None
    path = make_adapter(1)
    unknown = await stack.client.result("step-1")
    worker = stack.sim.workers["w000"]
    worker.set_faults(latency_s={"load": 3.0})  # pending long enough to be asked
    running = asyncio.create_task(
        stack.client.update("policy", path, version=1, update_id="step-1")
    )
    await asyncio.wait_for(worker.wait_until(lambda: worker.paused), 15)
    pending = await stack.client.result("step-1")
    finished = await asyncio.wait_for(running, 30)
    afterwards = await stack.client.result("step-1")

    assert (unknown.update_id, unknown.status) == ("step-1", UNKNOWN)
    assert (pending.status, pending.adapter, pending.version) == (PENDING, "policy", 1)
    assert finished.status == COMMITTED, finished.error
    assert afterwards == finished
    assert stack.sim.workers["w001"].count_requests("POST", "/v1/loras") == 1, "ran once"


async def test_lorabus_result_prints_it_and_exits_by_its_status(
    stack: EmbeddedStack, nats_url: str, fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None
    done = await stack.client.update("policy", make_adapter(1), version=1, update_id="step-1")
    args = ["result", "--nats", nats_url, "--fleet", fleet_name]

    shown = await run_lorabus(*args, "step-1", "--json")
    missing = await run_lorabus(*args, "step-404")

    assert done.committed, done.error
    assert shown.returncode == 0, shown
    assert json.loads(shown.stdout)["status"] == "committed"
    assert missing.returncode == 1, missing
    assert "unknown" in missing.stdout + missing.stderr
