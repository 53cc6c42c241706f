"""Simulated workers generate one token for the names they serve, as each engine does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import httpx
import pytest
from adapter_dirs import write_adapter

from lorabus.simfleet import SimFleet, SimWorker

API_KEY = "sim-secret"
PROMPT = "The capital of France is"
#: Bodies of a canary: one token, greedy, a fixed prompt.
VLLM_CANARY = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
SGLANG_CANARY = {"text": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    """w000 Dynamo, w001 vLLM, w002 SGLang, w003 Dynamo."""
    engines = ("dynamo", "vllm", "sglang")
    async with SimFleet.of_size(4, engines=engines, api_key=API_KEY) as started:
        yield started


@pytest.fixture
async def http(fleet: SimFleet) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=fleet.url, headers=headers, timeout=10) as client:
        yield client


def completion_shape(reply: httpx.Response) -> dict[str, Any]:
    """The completion without what changes from one call to the next."""
    body = reply.json()
    assert body.pop("id").startswith("cmpl-")
    assert isinstance(body.pop("created"), int)
    return body


def expected_completion(worker_id: str, model: str) -> dict[str, Any]:
    text = f"simulated reply from worker {worker_id} using model {model}"
    return {
        "object": "text_completion",
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }


async def held_until_resumed(
    worker: SimWorker, request: Awaitable[httpx.Response], resume: Awaitable[httpx.Response]
) -> httpx.Response:
    """Send ``request`` to the paused ``worker``, check that it is held, resume, answer."""
    held = asyncio.ensure_future(request)
    try:
        assert await worker.wait_until(lambda: worker.waiting_for_resume == 1)
        assert not held.done()
        assert (await resume).status_code == 200
        return await asyncio.wait_for(held, 10)
    finally:
        held.cancel()
        await asyncio.wait([held])


async def test_vllm_completes_one_token_for_its_base_model_and_its_adapters(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    fleet.workers["w001"].add_adapter("a", "/adapters/a")

    base = await http.post(
        "/workers/w001/v1/completions", json={**VLLM_CANARY, "model": "sim-base"}
    )
    adapter = await http.post("/workers/w001/v1/completions", json={**VLLM_CANARY, "model": "a"})

    assert base.status_code == adapter.status_code == 200
    assert completion_shape(base) == expected_completion("w001", "sim-base")
    assert completion_shape(adapter) == expected_completion("w001", "a")
    assert fleet.workers["w001"].count_requests("POST", "/v1/completions") == 2


async def test_vllm_answers_a_name_it_does_not_serve_with_its_not_found_error(
    http: httpx.AsyncClient,
) -> None:
    reply = await http.post("/workers/w001/v1/completions", json={**VLLM_CANARY, "model": "nope"})

    assert reply.status_code == 404
    assert reply.json() == {
        "error": {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


async def test_vllm_holds_a_completion_while_paused(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    await http.post("/workers/w001/pause", params={"mode": "keep"})

    reply = await held_until_resumed(
        fleet.workers["w001"],
        http.post("/workers/w001/v1/completions", json={**VLLM_CANARY, "model": "sim-base"}),
        http.post("/workers/w001/resume"),
    )

    assert reply.status_code == 200


async def test_a_held_completion_answers_503_when_the_fleet_stops(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    worker = fleet.workers["w001"]
    worker.paused = True
    held = asyncio.ensure_future(
        http.post("/workers/w001/v1/completions", json={**VLLM_CANARY, "model": "sim-base"})
    )
    try:
        assert await worker.wait_until(lambda: worker.waiting_for_resume == 1)
        await fleet.stop()
        reply = await asyncio.wait_for(held, 10)
    finally:
        held.cancel()
        await asyncio.wait([held])

    assert reply.status_code == 503


async def test_vllm_resets_its_prefix_cache_in_dev_mode_only(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    worker = fleet.workers["w001"]

    reset = await http.post("/workers/w001/reset_prefix_cache")
    worker.set_setup(dev_mode=False)
    unmounted = await http.post("/workers/w001/reset_prefix_cache")

    assert (reset.status_code, reset.json()) == (200, {"success": True})
    assert (unmounted.status_code, unmounted.json()) == (404, {"detail": "Not Found"})
    assert worker.cache_resets == 1
    assert worker.count_requests("POST", "/reset_prefix_cache") == 2


async def test_vllm_completion_takes_the_api_key_and_its_reset_does_not(fleet: SimFleet) -> None:
    async with httpx.AsyncClient(base_url=fleet.system_url("w001")) as anonymous:
        completion = await anonymous.post(
            "/v1/completions", json={**VLLM_CANARY, "model": "sim-base"}
        )
        reset = await anonymous.post("/reset_prefix_cache")

    assert (completion.status_code, completion.json()) == (401, {"error": "Unauthorized"})
    assert reset.status_code == 200


async def test_sglang_generates_one_token_for_its_base_model_and_its_adapters(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    fleet.workers["w002"].add_adapter("a", "/adapters/a")

    base = await http.post("/workers/w002/generate", json=SGLANG_CANARY)
    adapter = await http.post("/workers/w002/generate", json={**SGLANG_CANARY, "lora_path": "a"})

    assert base.status_code == adapter.status_code == 200
    assert base.json()["text"] == "simulated reply from worker w002 using model sim-base"
    body = adapter.json()
    assert isinstance(body["meta_info"].pop("id"), str)
    assert body == {
        "text": "simulated reply from worker w002 using model a",
        "meta_info": {
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": 5,
            "completion_tokens": 1,
        },
    }
    assert fleet.workers["w002"].count_requests("POST", "/generate") == 2


async def test_sglang_refuses_an_adapter_it_does_not_hold(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    fleet.workers["w002"].add_adapter("a", "/adapters/a")

    reply = await http.post("/workers/w002/generate", json={**SGLANG_CANARY, "lora_path": "nope"})

    assert reply.status_code == 400
    assert reply.json() == {
        "error": {
            "message": "The following requested LoRA adapters are not loaded: nope\n"
            "Loaded adapters: odict_keys(['a'])."
        }
    }


async def test_sglang_holds_a_generation_while_paused(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    await http.post("/workers/w002/pause_generation", json={"mode": "in_place"})

    reply = await held_until_resumed(
        fleet.workers["w002"],
        http.post("/workers/w002/generate", json=SGLANG_CANARY),
        http.post("/workers/w002/continue_generation", json={}),
    )

    assert reply.status_code == 200


async def test_sglang_flushes_its_cache_with_the_admin_key_and_generates_with_the_api_key(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    worker = fleet.workers["w002"]
    worker.set_setup(admin_api_key="admin-secret")
    admin = {"Authorization": "Bearer admin-secret"}

    refused = await http.post("/workers/w002/flush_cache")
    flushed = await http.post("/workers/w002/flush_cache", headers=admin)
    generated_with_admin_key = await http.post(
        "/workers/w002/generate", json=SGLANG_CANARY, headers=admin
    )

    assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
    assert flushed.status_code == 200
    assert flushed.text == (
        "Cache flushed.\nPlease check backend logs for more details. (When there are running "
        "or waiting requests, the operation will not be performed.)\n"
    )
    assert generated_with_admin_key.status_code == 401
    assert worker.cache_resets == 1
    assert worker.count_requests("POST", "/flush_cache") == 2


async def test_a_dynamo_worker_serves_no_generation_route(http: httpx.AsyncClient) -> None:
    reply = await http.post("/workers/w000/v1/completions", json={**VLLM_CANARY, "model": "x"})

    assert (reply.status_code, reply.text) == (404, "Route not found")


async def test_frontend_completions_go_round_robin_among_holders_like_chat(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    for worker_id in ("w000", "w003"):
        fleet.workers[worker_id].add_adapter("a", "/adapters/a")
    body = {**VLLM_CANARY, "model": "a"}

    first = await http.post("/v1/completions", json=body)
    chat = await http.post("/v1/chat/completions", json={"model": "a", "messages": []})
    third = await http.post("/v1/completions", json=body)

    assert completion_shape(first) == expected_completion("w000", "a")
    assert chat.json()["served_by"] == "w003"
    assert completion_shape(third) == expected_completion("w000", "a")
    counts = {
        w.worker_id: w.count_requests("POST", "/v1/completions") for w in fleet.workers.values()
    }
    assert counts == {"w000": 2, "w001": 0, "w002": 0, "w003": 0}


async def test_frontend_completion_goes_to_the_instance_nvext_names(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    for worker_id in ("w000", "w003"):
        fleet.workers[worker_id].add_adapter("a", "/adapters/a")
    target = fleet.workers["w003"]
    body = {**VLLM_CANARY, "model": "a", "nvext": {"backend_instance_id": target.instance_id}}

    replies = [await http.post("/v1/completions", json=body) for _ in range(3)]

    assert [r.json()["choices"][0]["text"] for r in replies] == [
        "simulated reply from worker w003 using model a"
    ] * 3
    assert target.count_requests("POST", "/v1/completions") == 3
    assert fleet.workers["w000"].count_requests("POST", "/v1/completions") == 0
    [recorded, *_] = target.requests
    assert (recorded.path, recorded.body) == ("/v1/completions", body)


async def test_frontend_refuses_a_targeted_completion_the_instance_cannot_serve(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    fleet.workers["w000"].add_adapter("a", "/adapters/a")
    elsewhere = {"backend_instance_id": fleet.workers["w003"].instance_id}

    not_held = await http.post(
        "/v1/completions", json={**VLLM_CANARY, "model": "a", "nvext": elsewhere}
    )
    no_such_instance = await http.post(
        "/v1/completions", json={**VLLM_CANARY, "model": "a", "nvext": {"backend_instance_id": 7}}
    )
    no_holder = await http.post("/v1/completions", json={**VLLM_CANARY, "model": "nope"})

    assert (not_held.status_code, not_held.json()) == (
        404,
        {"message": "Model not found", "type": "Not Found", "code": 404},
    )
    assert no_such_instance.status_code == 404
    assert "7" in no_such_instance.json()["message"]
    assert no_holder.json() == not_held.json()


async def test_frontend_holds_a_targeted_completion_while_its_worker_is_paused(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    worker = fleet.workers["w003"]
    await http.post("/workers/w003/engine/pause_generation", json={"mode": "keep"})
    body = {
        **VLLM_CANARY,
        "model": "sim-base",
        "nvext": {"backend_instance_id": worker.instance_id},
    }

    reply = await held_until_resumed(
        worker,
        http.post("/v1/completions", json=body),
        http.post("/workers/w003/engine/resume_generation", json={}),
    )

    assert reply.headers["x-served-by"] == "w003"


async def test_an_unroutable_adapter_is_listed_and_loaded_but_unknown_to_generation(
    fleet: SimFleet, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    path = str(write_adapter(tmp_path / "a"))
    loaded = [
        await http.post(
            "/workers/w000/v1/loras", json={"lora_name": "a", "source": {"uri": f"file://{path}"}}
        ),
        await http.post(
            "/workers/w001/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": path}
        ),
        await http.post(
            "/workers/w002/load_lora_adapter", json={"lora_name": "a", "lora_path": path}
        ),
    ]
    for worker_id in ("w000", "w001", "w002"):
        faults = await http.put(f"/sim/workers/{worker_id}/faults", json={"unroutable": ["a"]})
        assert faults.json()["faults"]["unroutable"] == ["a"]
    target = {"backend_instance_id": fleet.workers["w000"].instance_id}

    listed = (await http.get("/workers/w001/v1/models")).json()["data"]
    vllm = await http.post("/workers/w001/v1/completions", json={**VLLM_CANARY, "model": "a"})
    sglang = await http.post("/workers/w002/generate", json={**SGLANG_CANARY, "lora_path": "a"})
    targeted = await http.post(
        "/v1/completions", json={**VLLM_CANARY, "model": "a", "nvext": target}
    )

    assert [r.status_code for r in loaded] == [200, 200, 200]
    assert "a" in [card["id"] for card in listed]
    assert vllm.status_code == 404
    assert vllm.json()["error"]["message"] == "The model `a` does not exist."
    assert sglang.status_code == 400
    assert sglang.json()["error"]["message"].startswith(
        "The following requested LoRA adapters are not loaded: a\n"
    )
    assert (targeted.status_code, targeted.json()["message"]) == (404, "Model not found")
    assert fleet.workers["w000"].count_requests("POST", "/v1/completions") == 1


async def test_the_frontend_fails_the_round_robin_turn_of_an_unroutable_worker(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    for worker_id in ("w000", "w003"):
        fleet.workers[worker_id].add_adapter("a", "/adapters/a")
    fleet.workers["w003"].set_faults(unroutable=["a"])
    body = {**VLLM_CANARY, "model": "a"}

    replies = [await http.post("/v1/completions", json=body) for _ in range(4)]

    assert [r.status_code for r in replies] == [200, 404, 200, 404]


@pytest.mark.parametrize("unroutable", [[""], "a", [1]])
async def test_the_control_api_refuses_bad_unroutable_names(
    fleet: SimFleet, http: httpx.AsyncClient, unroutable: object
) -> None:
    reply = await http.put("/sim/workers/w001/faults", json={"unroutable": unroutable})

    assert reply.status_code == 400
    assert fleet.workers["w001"].faults.unroutable == []


async def test_frontend_completions_take_the_api_key(fleet: SimFleet) -> None:
    async with httpx.AsyncClient(base_url=fleet.url) as anonymous:
        reply = await anonymous.post("/v1/completions", json={**VLLM_CANARY, "model": "sim-base"})

    assert (reply.status_code, reply.json()) == (401, {"error": "unauthorized"})
