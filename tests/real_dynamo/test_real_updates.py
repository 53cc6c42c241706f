"""lorabus rolls adapters out on a real Dynamo 1.6.1 frontend and workers.

A coordinator and three agents (world sizes 2, 1, 4 by flag) run as processes
against the session's real fleet. What is checked is what the real services
say: each worker's own ``GET /v1/loras``, the frontend's ``/v1/models`` and
``/v1/rl/workers``, and the test worker's pause flag.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from conftest import WORLD_SIZES, frontend_models, start_lorabus, worker_loras, worker_state
from processes import Processes
from real_fleet import DynamoFleet

from lorabus.client import UpdateClient
from lorabus.schemas import ErrorCode

pytestmark = pytest.mark.real_dynamo

UPDATE_TIMEOUT_S = 90.0
RETIRE_DEADLINE_S = 30.0


async def _polled(read: Callable[[], Awaitable[set[str]]], gone: str) -> set[str]:
    """Read until ``gone`` is no longer listed, or the deadline passes."""
    deadline = time.monotonic() + RETIRE_DEADLINE_S
    listed = await read()
    while gone in listed and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        listed = await read()
    return listed


async def test_two_versions_commit_and_every_real_worker_serves_them(
    processes: Processes,
    dynamo: DynamoFleet,
    client: UpdateClient,
    http: httpx.AsyncClient,
    nats_url: str,
    make_adapter: Callable[[int], str],
) -> None:
    await start_lorabus(processes, dynamo, client, nats_url)

    first = await client.update("commits", make_adapter(1), version=1, timeout_s=UPDATE_TIMEOUT_S)
    second = await client.update("commits", make_adapter(2), version=2, timeout_s=UPDATE_TIMEOUT_S)

    assert first.committed, first.error
    assert second.committed, second.error
    assert second.adapter == "commits-v2"
    for worker_id in WORLD_SIZES:
        assert {"commits-v1", "commits-v2"} <= await worker_loras(http, dynamo, worker_id)
        assert "commits-v2" in second.workers[worker_id].adapters
    assert {"commits-v1", "commits-v2"} <= await frontend_models(http, dynamo)


async def test_versions_beyond_keep_are_unloaded_from_every_real_worker(
    processes: Processes,
    dynamo: DynamoFleet,
    client: UpdateClient,
    http: httpx.AsyncClient,
    nats_url: str,
    make_adapter: Callable[[int], str],
) -> None:
    await start_lorabus(processes, dynamo, client, nats_url, keep=1)

    for version in (1, 2):
        result = await client.update(
            "kept", make_adapter(version), version=version, timeout_s=UPDATE_TIMEOUT_S
        )
        assert result.committed, result.error

    # Each agent retires the old version itself, after the update is answered.
    for worker_id in WORLD_SIZES:
        loras = await _polled(lambda w=worker_id: worker_loras(http, dynamo, w), "kept-v1")
        assert "kept-v2" in loras and "kept-v1" not in loras, (worker_id, loras)
    models = await _polled(lambda: frontend_models(http, dynamo), "kept-v1")
    assert "kept-v2" in models and "kept-v1" not in models, models


async def test_a_load_the_real_worker_rejects_fails_with_its_message_and_all_resume(
    processes: Processes,
    dynamo: DynamoFleet,
    client: UpdateClient,
    http: httpx.AsyncClient,
    nats_url: str,
    tmp_path: Path,
) -> None:
    not_an_adapter = tmp_path / "notes"
    not_an_adapter.mkdir()
    (not_an_adapter / "README.md").write_text("no adapter here\n")
    await start_lorabus(processes, dynamo, client, nats_url)

    result = await client.update(
        "rejected", str(not_an_adapter), version=1, timeout_s=UPDATE_TIMEOUT_S
    )

    assert result.status == "failed"
    assert result.error is not None and result.error.code == ErrorCode.WORKER_FAILED, result.error
    worker_words = f"Loading lora rejected-v1 failed: No adapter found for {not_an_adapter}"
    for worker_id in WORLD_SIZES:
        outcome = result.workers[worker_id]
        assert not outcome.ok and outcome.error is not None, outcome
        assert "answered 500" in outcome.error.message, outcome.error
        assert worker_words in outcome.error.message, outcome.error
        assert worker_id in result.error.message
        assert (await worker_state(http, dynamo, worker_id))["paused"] is False, worker_id
        assert "rejected-v1" not in await worker_loras(http, dynamo, worker_id)
    status = await client.status()
    assert [(m.worker_id, m.paused) for m in status.members] == [
        (worker_id, False) for worker_id in WORLD_SIZES
    ]


async def test_rank_map_takes_world_sizes_from_agent_flags_when_discovery_has_none(
    processes: Processes,
    dynamo: DynamoFleet,
    client: UpdateClient,
    http: httpx.AsyncClient,
    nats_url: str,
    make_adapter: Callable[[int], str],
) -> None:
    discovery = (await http.get(f"{dynamo.rl_url}/v1/rl/workers")).json()["workers"]
    ours = {dynamo.system_url(w) for w in WORLD_SIZES}
    entries = [entry for entry in discovery if entry.get("system_url") in ours]
    assert len(entries) == len(WORLD_SIZES), discovery
    assert all("world_size" not in entry for entry in entries), entries
    await start_lorabus(processes, dynamo, client, nats_url)

    result = await client.update("ranks", make_adapter(1), version=1, timeout_s=UPDATE_TIMEOUT_S)

    assert result.committed and result.rank_map is not None, result.error
    assert [(e.worker_id, e.world_size, e.rank_offset) for e in result.rank_map.entries] == [
        ("w000", 2, 1),
        ("w001", 1, 3),
        ("w002", 4, 4),
    ]
    assert result.rank_map.world_size == 1 + sum(WORLD_SIZES.values())
    assert {w: o.world_size for w, o in result.workers.items()} == WORLD_SIZES
