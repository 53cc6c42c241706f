"""The simulated frontend lists, discovers and routes like Dynamo's."""

from __future__ import annotations

import asyncio

import httpx

from lorabus.simfleet import SimFleet


def load_body(name: str, uri: str) -> dict:
    return {"lora_name": name, "source": {"uri": uri}}


def chat_body(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def load(client: httpx.AsyncClient, worker_id: str, name: str, uri: str) -> None:
    reply = await client.post(f"/workers/{worker_id}/v1/loras", json=load_body(name, uri))
    assert reply.json()["status"] == "success"


async def test_models_list_base_model_and_union_of_adapters(client, adapter_uri):
    await load(client, "w000", "zeta", adapter_uri("z"))
    await load(client, "w002", "alpha", adapter_uri("a"))

    models = (await client.get("/v1/models")).json()

    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["sim-base", "alpha", "zeta"]
    assert {(m["object"], m["owned_by"]) for m in models["data"]} == {("model", "nvidia")}
    assert all(isinstance(m["created"], int) for m in models["data"])


async def test_models_drop_an_adapter_once_no_worker_holds_it(client, adapter_uri):
    await load(client, "w000", "l1", adapter_uri())
    await client.delete("/workers/w000/v1/loras/l1")

    models = (await client.get("/v1/models")).json()

    assert [m["id"] for m in models["data"]] == ["sim-base"]


async def test_rl_workers_describe_every_worker(sim, client):
    discovery = (await client.get("/v1/rl/workers")).json()

    assert (discovery["protocol_version"], discovery["namespace"]) == (1, "dynamo")
    first = discovery["workers"][0]
    instance_id = sim.workers["w000"].instance_id
    assert first == {
        "namespace": "dynamo",
        "component": "backend",
        "endpoint": "rl",
        "instance_id": instance_id,
        "transport": {
            "tcp": f"{sim.url.removeprefix('http://')}/{instance_id:016x}/dynamo/backend/rl"
        },
        "request_plane_url": "dyn://dynamo.backend.rl",
        "system_url": sim.system_url("w000"),
        "model": "sim-base",
        "routes": [
            "liveness_probe",
            "load_lora",
            "pause_generation",
            "resume_generation",
            "unload_lora",
        ],
        "world_size": 1,
    }
    assert [w["world_size"] for w in discovery["workers"]] == [1, 2, 1]
    assert len({w["instance_id"] for w in discovery["workers"]}) == 3
    assert all(0 <= w["instance_id"] < 2**64 for w in discovery["workers"])


async def test_chat_routes_only_to_workers_holding_the_adapter(client, adapter_uri):
    uri = adapter_uri()
    await load(client, "w000", "l1", uri)
    await load(client, "w002", "l1", uri)

    replies = [await client.post("/v1/chat/completions", json=chat_body("l1")) for _ in range(4)]

    served = [r.json()["served_by"] for r in replies]
    assert served == ["w000", "w002", "w000", "w002"]
    assert [r.headers["x-served-by"] for r in replies] == served
    completion = replies[0].json()
    assert completion["object"] == "chat.completion"
    assert completion["model"] == "l1"
    [choice] = completion["choices"]
    assert "w000" in choice["message"]["content"]
    assert "l1" in choice["message"]["content"]


async def test_chat_for_base_model_uses_every_worker(client):
    replies = [
        await client.post("/v1/chat/completions", json=chat_body("sim-base")) for _ in range(3)
    ]

    assert sorted(r.json()["served_by"] for r in replies) == ["w000", "w001", "w002"]


async def test_chat_for_unknown_model_is_404(client):
    reply = await client.post("/v1/chat/completions", json=chat_body("nope"))

    assert reply.status_code == 404
    assert reply.json() == {"message": "Model not found", "type": "Not Found", "code": 404}


async def test_chat_with_bad_body_is_400(client):
    reply = await client.post("/v1/chat/completions", json={"messages": []})

    assert reply.status_code == 400
    assert reply.json()["type"] == "Bad Request"
    assert reply.json()["message"].startswith("Failed to deserialize the JSON body")


async def test_chat_to_a_paused_worker_waits_for_resume(sim, client, adapter_uri):
    worker = sim.workers["w001"]
    await load(client, "w001", "l1", adapter_uri())
    await client.post("/workers/w001/engine/pause_generation", json={"mode": "keep"})
    held = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body("l1")))
    try:
        assert await worker.wait_until(lambda: worker.waiting_for_resume == 1)
        assert not held.done()

        await client.post("/workers/w001/engine/resume_generation", json={})
        reply = await asyncio.wait_for(held, 10)
    finally:
        held.cancel()
        await asyncio.wait([held])
    assert reply.json()["served_by"] == "w001"


async def test_chat_to_a_worker_paused_too_long_is_503(adapter_uri):
    async with (
        SimFleet(["a"], [1], paused_wait_s=0.01) as sim,
        httpx.AsyncClient(base_url=sim.url) as http,
    ):
        sim.workers["a"].paused = True

        reply = await http.post("/v1/chat/completions", json=chat_body("sim-base"))

    assert reply.status_code == 503


async def test_frontend_requires_bearer_token_when_api_key_set(secured_sim):
    async with httpx.AsyncClient(base_url=secured_sim.url) as http:
        refused = await http.get("/v1/models")
        accepted = await http.get("/v1/models", headers={"Authorization": "Bearer sim-secret"})

    assert (refused.status_code, refused.json()) == (401, {"error": "unauthorized"})
    assert accepted.status_code == 200
