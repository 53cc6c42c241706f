"""An update a real vLLM server refuses fails cleanly: the engine's reason in
the result, every engine resumed, nothing new served anywhere.

The tier's two servers differ only in ``--max-lora-rank`` (w000: 16,
w001: 8), so a rank-16 adapter loads on w000 and fails on w001: lorabus must
unload it from w000 again. A directory without an adapter fails on both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from lorabus.client import UpdateClient
from lorabus.schemas import ErrorCode
from lorabus.testbed.trainer import write_adapter
from real_vllm.vllm_server import (
    MAX_LORA_RANKS,
    TEST_TIMEOUT_S,
    VllmFleet,
    is_paused,
    served_adapters,
)

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(TEST_TIMEOUT_S)]

UPDATE_TIMEOUT_S = 120.0
PAUSE, RESUME = ("POST", "/pause?mode=keep"), ("POST", "/resume")


async def _check_resumed_and_not_serving(
    http: httpx.AsyncClient, vllm: VllmFleet, client: UpdateClient, name: str
) -> None:
    for worker_id in MAX_LORA_RANKS:
        assert not await is_paused(http, vllm.url(worker_id)), worker_id
        assert name not in await served_adapters(http, vllm.url(worker_id)), worker_id
    status = await client.status()
    assert [(m.worker_id, m.paused) for m in status.members] == [
        (worker_id, False) for worker_id in MAX_LORA_RANKS
    ]


async def test_an_adapter_one_server_refuses_fails_with_its_reason_and_is_unloaded_from_the_other(
    vllm: VllmFleet,
    client: UpdateClient,
    http: httpx.AsyncClient,
    start_lorabus: Callable[..., Awaitable[None]],
    tmp_path: Path,
) -> None:
    rank16 = write_adapter(tmp_path / "adapters", 1, rank=16, hidden=128, layers=2)
    await start_lorabus()
    pauses = {w: vllm.servers[w].access_log(*PAUSE) for w in MAX_LORA_RANKS}

    result = await client.update("too-big", str(rank16), version=1, timeout_s=UPDATE_TIMEOUT_S)

    assert result.status == "failed"
    assert result.error is not None and result.error.code == ErrorCode.WORKER_FAILED, result.error
    assert "w001" in result.error.message
    refused = result.workers["w001"]
    assert not refused.ok and refused.error is not None, refused
    assert "LoRA rank 16 is greater than max_lora_rank 8." in refused.error.message
    assert result.workers["w000"].ok, result.workers["w000"]
    # Both engines were paused for the load and are running again.
    assert all(vllm.servers[w].access_log(*PAUSE) == n + 1 for w, n in pauses.items())
    await _check_resumed_and_not_serving(http, vllm, client, "too-big-v1")


async def test_a_directory_without_an_adapter_fails_with_the_engines_words(
    vllm: VllmFleet,
    client: UpdateClient,
    http: httpx.AsyncClient,
    start_lorabus: Callable[..., Awaitable[None]],
    tmp_path: Path,
) -> None:
    not_an_adapter = tmp_path / "notes"
    not_an_adapter.mkdir()
    (not_an_adapter / "README.md").write_text("no adapter here\n")
    await start_lorabus()

    result = await client.update(
        "rejected", str(not_an_adapter), version=1, timeout_s=UPDATE_TIMEOUT_S
    )

    assert result.status == "failed"
    assert result.error is not None and result.error.code == ErrorCode.WORKER_FAILED, result.error
    for worker_id in MAX_LORA_RANKS:
        outcome = result.workers[worker_id]
        assert not outcome.ok and outcome.error is not None, outcome
        assert "answered 404: Loading lora rejected-v1 failed: No adapter found for" in (
            outcome.error.message
        ), outcome.error
        assert "(final: not retried)" in outcome.error.message, outcome.error
        assert worker_id in result.error.message
    await _check_resumed_and_not_serving(http, vllm, client, "rejected-v1")
