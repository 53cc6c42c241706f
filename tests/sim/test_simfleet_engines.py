"""Simulated vLLM and SGLang workers answer as those engines document, beside Dynamo ones."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from processes import run_lorabus

from lorabus.simfleet import SimFleet

API_KEY = "sim-secret"


@pytest.fixture
async def mixed() -> AsyncIterator[SimFleet]:
    """w000 Dynamo, w001 vLLM, w002 SGLang, w003 Dynamo again (cycled)."""
    async with SimFleet.of_size(4, engines=("dynamo", "vllm", "sglang"), api_key=API_KEY) as fleet:
        yield fleet


@pytest.fixture
async def http(mixed: SimFleet) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=mixed.url, headers=headers, timeout=10) as client:
        yield client


def _adapter(adapter_uri: Callable[..., str], name: str = "adapter") -> str:
    return adapter_uri(name).removeprefix("file://")


async def test_engines_are_cycled_over_the_workers_and_dynamo_is_the_default() -> None:
    fleet = SimFleet.of_size(4, engines=("dynamo", "vllm", "sglang"))
    assert [w.engine for w in fleet.workers.values()] == ["dynamo", "vllm", "sglang", "dynamo"]
    assert {w.engine for w in SimFleet.of_size(2).workers.values()} == {"dynamo"}
    with pytest.raises(ValueError, match="engine of w000"):
        SimFleet.of_size(1, engines=("trtllm",))


async def test_vllm_answers_loads_in_plain_text_and_errors_as_nested_json(
    mixed: SimFleet, http: httpx.AsyncClient, adapter_uri: Callable[..., str], tmp_path: Path
) -> None:
    url = "/workers/w001/v1/load_lora_adapter"
    path = _adapter(adapter_uri)

    loaded = await http.post(url, json={"lora_name": "p", "lora_path": path})
    again = await http.post(url, json={"lora_name": "p", "lora_path": path})
    (tmp_path / "empty").mkdir()
    missing = await http.post(url, json={"lora_name": "q", "lora_path": str(tmp_path / "empty")})
    not_json = await http.post(url, content=b"lora_name=p", headers={"Content-Type": "text/plain"})
    unknown = await http.post("/workers/w001/v1/unload_lora_adapter", json={"lora_name": "nope"})

    assert loaded.status_code == 200
    assert loaded.text == "Success: LoRA adapter 'p' added successfully."
    assert "content-type" not in loaded.headers or "json" not in loaded.headers["content-type"]
    assert again.status_code == 400
    assert again.json()["error"]["type"] == "InvalidUserInput"
    assert "has already been loaded" in again.json()["error"]["message"]
    assert missing.status_code == 404
    assert missing.json() == {
        "error": {
            "message": "Loading lora q failed: No adapter found for <path>",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }
    assert not_json.status_code == 400
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."
    models = (await http.get("/workers/w001/v1/models")).json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in models] == [
        ("sim-base", "sim-base", None),
        ("p", path, "sim-base"),
    ]


async def test_vllm_pauses_by_query_mode_and_guards_only_its_v1_paths(
    mixed: SimFleet, http: httpx.AsyncClient
) -> None:
    worker = mixed.workers["w001"]
    async with httpx.AsyncClient(base_url=mixed.url, timeout=10) as anonymous:
        paused = await anonymous.post("/workers/w001/pause", params={"mode": "keep"})
        is_paused = await anonymous.get("/workers/w001/is_paused")
        refused = await anonymous.get("/workers/w001/v1/models")
        bad_mode = await anonymous.post("/workers/w001/pause", params={"mode": "sometimes"})
        resumed = await anonymous.post("/workers/w001/resume")

    assert (paused.status_code, paused.json()) == (200, {"status": "paused"})
    assert is_paused.json() == {"is_paused": True}
    assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
    assert bad_mode.status_code == 400
    assert (resumed.status_code, resumed.json()) == (200, {"status": "resumed"})
    assert not worker.paused


async def test_sglang_answers_success_error_message_and_loaded_adapters(
    mixed: SimFleet, http: httpx.AsyncClient, adapter_uri: Callable[..., str], tmp_path: Path
) -> None:
    path = _adapter(adapter_uri)
    load = "/workers/w002/load_lora_adapter"

    loaded = await http.post(load, json={"lora_name": "p", "lora_path": path})
    again = await http.post(load, json={"lora_name": "p", "lora_path": path})
    missing = await http.post(load, json={"lora_name": "q", "lora_path": str(tmp_path / "none")})
    malformed = await http.post(load, json={"lora_name": "q"})
    unknown = await http.post("/workers/w002/unload_lora_adapter", json={"lora_name": "nope"})
    unloaded = await http.post("/workers/w002/unload_lora_adapter", json={"lora_name": "p"})

    assert loaded.status_code == 200
    assert loaded.headers["content-type"].startswith("application/json")
    assert loaded.json() == {
        "rid": None,
        "http_worker_ipc": None,
        "success": True,
        "error_message": "",
        "loaded_adapters": {"p": path},
    }
    assert again.status_code == 400 and again.json()["success"] is False
    assert "because it is already loaded" in again.json()["error_message"]
    assert missing.status_code == 400 and missing.json()["success"] is False
    assert malformed.status_code == 400 and malformed.json()["object"] == "error"
    assert unknown.status_code == 400
    assert unknown.json()["error_message"].startswith("LoRA with name nope does not exist.")
    assert unknown.json()["loaded_adapters"] is None
    assert unloaded.json()["loaded_adapters"] == {}


async def test_sglang_pauses_in_the_mode_asked_and_continues(
    mixed: SimFleet, http: httpx.AsyncClient
) -> None:
    worker = mixed.workers["w002"]

    paused = await http.post("/workers/w002/pause_generation", json={"mode": "in_place"})
    held = worker.paused
    bad_mode = await http.post("/workers/w002/pause_generation", json={"mode": "keep"})
    resumed = await http.post("/workers/w002/continue_generation", json={})

    assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
    assert held and not worker.paused
    assert bad_mode.status_code == 400
    assert resumed.json() == {"message": "Generation continued successfully.", "status": "ok"}


async def test_each_worker_serves_only_its_own_engines_routes(
    mixed: SimFleet, http: httpx.AsyncClient
) -> None:
    dynamo_on_vllm = await http.get("/workers/w001/v1/loras")
    vllm_on_dynamo = await http.get("/workers/w000/v1/models")
    sglang_on_vllm = await http.post("/workers/w001/pause_generation", json={"mode": "abort"})

    assert (dynamo_on_vllm.status_code, dynamo_on_vllm.json()) == (404, {"detail": "Not Found"})
    assert vllm_on_dynamo.status_code == 404 and vllm_on_dynamo.text == "Route not found"
    assert sglang_on_vllm.status_code == 404
    assert not any(w.paused for w in mixed.workers.values())


async def test_the_frontend_lists_adapters_of_every_engine_kind(
    mixed: SimFleet, http: httpx.AsyncClient, adapter_uri: Callable[..., str]
) -> None:
    path = _adapter(adapter_uri)
    await http.post(
        "/workers/w000/v1/loras", json={"lora_name": "d", "source": {"uri": f"file://{path}"}}
    )
    await http.post(
        "/workers/w001/v1/load_lora_adapter", json={"lora_name": "v", "lora_path": path}
    )
    await http.post("/workers/w002/load_lora_adapter", json={"lora_name": "s", "lora_path": path})

    listed = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]

    assert listed == ["sim-base", "d", "s", "v"]


async def test_lorabus_sim_refuses_an_unknown_engine() -> None:
    done = await run_lorabus("sim", "--engines", "dynamo,trtllm", "--port", "0")

    assert done.returncode == 2, done
    assert "dynamo, vllm, sglang" in done.stderr
