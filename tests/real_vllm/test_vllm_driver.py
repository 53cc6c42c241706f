"""lorabus's vLLM driver keeps its contract against a real vLLM 0.32.0 server.

The driver is built the way an agent builds it (``driver_for`` from an
``AgentConfig`` with ``engine="vllm"``) and pointed at the tier's server
w001 (``--max-lora-rank 8``). What is checked is what the real server says
back: its ``GET /is_paused``, its ``GET /v1/models``, and its access log,
which shows every request it answered. Adapters come from lorabus's own demo
trainer (``write_adapter``), shaped for the install's tiny model. The
simulated vLLM passes the same contract in ``tests/test_engine_drivers.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from lorabus.agents import AgentConfig, EngineDriver, driver_for
from lorabus.errors import EngineError
from lorabus.testbed.trainer import write_adapter
from real_vllm.vllm_server import (
    BASE_MODEL,
    TEST_TIMEOUT_S,
    VllmFleet,
    VllmServer,
    is_paused,
    served_adapters,
)

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(TEST_TIMEOUT_S)]

WORKER = "w001"
#: The tiny model's geometry (scripts/install-real-vllm).
HIDDEN, LAYERS = 128, 2
#: How long a request sent to the paused server is watched: it must not be
#: answered meanwhile (a slow machine only makes the check weaker).
HELD_S = 1.0
STREAM_WITH_USAGE = {"stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture
def server(vllm: VllmFleet) -> VllmServer:
    return vllm.servers[WORKER]


@pytest.fixture
async def driver(server: VllmServer) -> AsyncIterator[EngineDriver]:
    config = AgentConfig(
        fleet="f", worker_id=WORKER, system_url=server.url, engine="vllm", engine_timeout_s=30
    )
    engine = driver_for(config)
    yield engine
    await engine.aclose()


@pytest.fixture(autouse=True)
async def _resumed_after(server: VllmServer, http: httpx.AsyncClient) -> AsyncIterator[None]:
    """The server is shared: whatever a test does, it runs again afterwards."""
    yield
    await http.post(f"{server.url}/resume")


def _adapter(tmp_path: Path, step: int, rank: int = 8) -> str:
    return str(write_adapter(tmp_path / "adapters", step, rank=rank, hidden=HIDDEN, layers=LAYERS))


async def test_pause_load_list_unload_resume_on_the_real_server(
    server: VllmServer, driver: EngineDriver, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    path = _adapter(tmp_path, 1)
    name = "contract/policy-v1"
    pauses = server.access_log("POST", "/pause?mode=keep")

    await driver.pause()
    paused = await is_paused(http, server.url)
    await driver.load_adapter(name, path, budget_s=30)
    listed = await driver.list_adapters()
    served = await served_adapters(http, server.url)
    await driver.unload_adapter(name)
    served_after_unload = await served_adapters(http, server.url)
    await driver.resume()

    assert driver.kind == "vllm"
    assert paused, "the driver's pause left the real server running"
    assert server.access_log("POST", "/pause?mode=keep") == pauses + 1
    assert name in listed
    assert served[name] == path
    assert name not in served_after_unload
    assert not await is_paused(http, server.url)


async def test_keep_mode_holds_requests_across_the_pause_and_drops_none(
    server: VllmServer, driver: EngineDriver, http: httpx.AsyncClient
) -> None:
    """Why the driver pauses with ``mode=keep``: a request in flight is
    frozen and continues on resume (``abort``, vLLM's default, would end it
    with ``finish_reason: abort``), and one sent while paused waits."""
    body = {"model": BASE_MODEL, "prompt": "hello", "max_tokens": 64, "ignore_eos": True}
    streamed: list[dict[str, Any]] = []
    async with http.stream(
        "POST", f"{server.url}/v1/completions", json=body | STREAM_WITH_USAGE
    ) as stream:
        lines = stream.aiter_lines()
        async for line in lines:
            if line.startswith("data: {"):
                streamed.append(json.loads(line.removeprefix("data: ")))
                break  # in flight: its first token is out
        await driver.pause()
        sent_while_paused = asyncio.create_task(
            http.post(f"{server.url}/v1/completions", json=body | {"max_tokens": 4})
        )
        done, _ = await asyncio.wait({sent_while_paused}, timeout=HELD_S)
        await driver.resume()
        async for line in lines:
            if line.startswith("data: {"):
                streamed.append(json.loads(line.removeprefix("data: ")))
        answered = await sent_while_paused

    assert not done, f"a request sent while paused was answered: {answered.text}"
    assert answered.status_code == 200, answered.text
    finish = [c["finish_reason"] for chunk in streamed for c in chunk["choices"]]
    assert [f for f in finish if f is not None] == ["length"], finish
    assert streamed[-1]["usage"]["completion_tokens"] == body["max_tokens"], streamed[-1]


@pytest.mark.parametrize("what", ["a directory without an adapter", "a path that does not exist"])
async def test_a_load_without_an_adapter_is_a_final_engine_error(
    what: str, server: VllmServer, driver: EngineDriver, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    path = tmp_path / "step_7"
    if what == "a directory without an adapter":
        path.mkdir()
        (path / "README.md").write_text("no adapter here\n")
    loads = server.access_log("POST", "/v1/load_lora_adapter")

    with pytest.raises(EngineError) as raised:
        await driver.load_adapter("contract-missing-v1", str(path), budget_s=30)

    error = raised.value
    assert error.status == 404 and not error.retryable, error
    # vLLM 0.32.0 writes "<path>" in place of the path.
    assert "answered 404: Loading lora contract-missing-v1 failed: No adapter found for" in str(
        error
    )
    assert str(error).endswith("(final: not retried)"), error
    assert server.access_log("POST", "/v1/load_lora_adapter") == loads + 1
    assert "contract-missing-v1" not in await served_adapters(http, server.url)


async def test_unloading_a_name_the_server_lacks_is_a_404_engine_error(
    driver: EngineDriver,
) -> None:
    with pytest.raises(EngineError, match="answered 404") as raised:
        await driver.unload_adapter("contract-never-loaded")

    assert raised.value.status == 404 and not raised.value.retryable
    assert "The lora adapter 'contract-never-loaded' cannot be found." in str(raised.value)


async def test_loading_a_name_again_from_the_same_path_is_done(
    server: VllmServer, driver: EngineDriver, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    """A retry after a lost answer: the real server refuses the name (400
    "has already been loaded"), the driver reads ``/v1/models`` and sees the
    same path."""
    path = _adapter(tmp_path, 1)
    await driver.load_adapter("contract-again-v1", path, budget_s=30)
    refusals = server.access_log("POST", "/v1/load_lora_adapter")

    await driver.load_adapter("contract-again-v1", path, budget_s=30)
    served = await served_adapters(http, server.url)
    await driver.unload_adapter("contract-again-v1")

    assert served["contract-again-v1"] == path
    assert server.access_log("POST", "/v1/load_lora_adapter") == refusals + 1


async def test_loading_a_name_again_from_another_path_is_a_final_error(
    server: VllmServer, driver: EngineDriver, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    first, other = _adapter(tmp_path, 1), _adapter(tmp_path, 2)
    await driver.load_adapter("contract-other-v1", first, budget_s=30)

    with pytest.raises(EngineError, match="has already been loaded") as raised:
        await driver.load_adapter("contract-other-v1", other, budget_s=30)
    served = await served_adapters(http, server.url)
    await driver.unload_adapter("contract-other-v1")

    assert raised.value.status == 400 and not raised.value.retryable
    assert repr(first) in str(raised.value) and repr(other) in str(raised.value)
    assert served["contract-other-v1"] == first


async def test_a_rank_over_the_servers_maximum_is_a_final_error(
    server: VllmServer, driver: EngineDriver, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    """vLLM answers an adapter of a rank above ``--max-lora-rank`` with a 500,
    which would read as transient; its words say the answer cannot change,
    so the driver gives up after one request."""
    path = _adapter(tmp_path, 1, rank=16)
    loads = server.access_log("POST", "/v1/load_lora_adapter")

    with pytest.raises(EngineError) as raised:
        await driver.load_adapter("contract-rank16-v1", path, budget_s=60)

    error = raised.value
    assert error.status == 500, error
    assert (
        "answered 500: Call to add_lora method failed: Worker failed with error "
        "'LoRA rank 16 is greater than max_lora_rank 8.'"
    ) in str(error)
    assert not error.retryable and str(error).endswith("(final: not retried)"), error
    assert server.access_log("POST", "/v1/load_lora_adapter") == loads + 1
    assert "contract-rank16-v1" not in await served_adapters(http, server.url)
