"""The simulated worker system server behaves like a Dynamo worker's."""

from __future__ import annotations

import asyncio

import httpx

from lorabus.simfleet import SimFleet, lora_id_for

W0 = "/workers/w000"


def load_body(name: str, uri: str) -> dict:
    return {"lora_name": name, "source": {"uri": uri}}


async def finish(task: asyncio.Task) -> None:
    """Cancel ``task`` if still running and wait until it has ended."""
    task.cancel()
    await asyncio.wait([task])


async def test_load_succeeds_and_reads_back(client, adapter_uri):
    reply = await client.post(f"{W0}/v1/loras", json=load_body("l1", adapter_uri()))

    assert reply.status_code == 200
    assert reply.json() == {
        "status": "success",
        "message": "LoRA adapter 'l1' loaded successfully",
        "lora_name": "l1",
        "lora_id": lora_id_for("l1"),
    }
    listed = (await client.get(f"{W0}/v1/loras")).json()
    assert listed == {"status": "success", "loras": {"l1": lora_id_for("l1")}, "count": 1}


async def test_load_accepts_a_percent_encoded_file_uri(client, tmp_path, adapter_uri):
    adapter_uri("with space")

    uri = (tmp_path / "with space").as_uri()
    reply = await client.post(f"{W0}/v1/loras", json=load_body("l1", uri))

    assert "%20" in uri
    assert reply.json()["status"] == "success"


async def test_lora_id_is_the_same_on_every_worker(client, adapter_uri):
    uri = adapter_uri()
    ids = [
        (await client.post(f"/workers/{w}/v1/loras", json=load_body("l1", uri))).json()["lora_id"]
        for w in ("w000", "w001")
    ]
    assert ids[0] == ids[1]
    assert 0 < ids[0] < 2**31


async def test_loading_a_loaded_name_answers_already_loaded_without_checking_path(
    client, adapter_uri
):
    await client.post(f"{W0}/v1/loras", json=load_body("l1", adapter_uri()))

    again = await client.post(f"{W0}/v1/loras", json=load_body("l1", "file:///no/such/dir"))

    assert again.status_code == 200
    assert again.json()["status"] == "success"
    assert again.json()["message"] == "LoRA adapter 'l1' already loaded"
    assert again.json()["lora_id"] == lora_id_for("l1")


async def test_missing_directory_fails_with_the_downloaders_not_found(client):
    reply = await client.post(f"{W0}/v1/loras", json=load_body("bad", "file:///no/such/dir"))

    assert reply.status_code == 500
    assert reply.json() == {
        "status": "error",
        "message": "Failed to download LoRA: Download failed: "
        "Local LoRA not found: file:///no/such/dir",
    }


async def test_directory_without_config_is_not_an_adapter(client, adapter_uri):
    uri = adapter_uri(config=False)

    reply = await client.post(f"{W0}/v1/loras", json=load_body("bad", uri))

    assert reply.status_code == 500
    path = uri.removeprefix("file://")
    assert reply.json() == {
        "status": "error",
        "message": "Failed to add LoRA 'bad': Loading lora bad failed: "
        f"No adapter found for {path} (no adapter_config.json)",
        "lora_name": "bad",
    }


async def test_directory_without_weights_is_not_an_adapter(client, adapter_uri):
    uri = adapter_uri(weights=False)

    reply = await client.post(f"{W0}/v1/loras", json=load_body("bad", uri))

    assert reply.status_code == 500
    assert reply.json()["message"].endswith("(no adapter_model.safetensors)")


async def test_unsupported_scheme_is_not_found_in_any_source(client):
    reply = await client.post(f"{W0}/v1/loras", json=load_body("s3", "s3://bucket/adapter"))

    assert reply.status_code == 500
    assert reply.json() == {
        "status": "error",
        "message": "Failed to download LoRA: Download failed: "
        "LoRA s3://bucket/adapter not found in any source",
    }


async def test_empty_name_is_refused(client, adapter_uri):
    reply = await client.post(f"{W0}/v1/loras", json=load_body("", adapter_uri()))

    assert reply.status_code == 500
    assert reply.json() == {
        "status": "error",
        "message": "'lora_name' is required and must be a string",
    }


async def test_status_error_quirk_answers_200_with_error_body(sim, client):
    sim.workers["w000"].set_faults(status_error_quirk=True)

    reply = await client.post(f"{W0}/v1/loras", json=load_body("bad", "file:///no/such/dir"))

    assert reply.status_code == 200
    assert reply.json()["status"] == "error"
    assert "Local LoRA not found" in reply.json()["message"]


async def test_load_body_of_the_wrong_shape_gets_plain_text_422(client):
    for body in (b'{"lora_name": "x"}', b'{"lora_name": 1, "source": {"uri": "a"}}'):
        reply = await client.post(
            f"{W0}/v1/loras", content=body, headers={"content-type": "application/json"}
        )
        assert reply.status_code == 422
        assert reply.headers["content-type"].startswith("text/plain")
        assert reply.text.startswith("Failed to deserialize the JSON body into the target type: ")


async def test_load_body_that_is_not_json_gets_plain_text_400(client):
    reply = await client.post(
        f"{W0}/v1/loras", content=b"not json", headers={"content-type": "application/json"}
    )

    assert reply.status_code == 400
    assert reply.headers["content-type"].startswith("text/plain")
    assert reply.text.startswith("Failed to parse the request body as JSON: ")


async def test_load_without_json_content_type_gets_415(client):
    reply = await client.post(f"{W0}/v1/loras", content=b"{}")

    assert reply.status_code == 415
    assert reply.text == "Expected request with `Content-Type: application/json`"


async def test_fail_next_loads_injects_that_many_failures(sim, client, adapter_uri):
    worker = sim.workers["w000"]
    worker.set_faults(fail_next_loads=2)
    uri = adapter_uri()

    replies = [await client.post(f"{W0}/v1/loras", json=load_body("l1", uri)) for _ in range(3)]

    assert [r.status_code for r in replies] == [500, 500, 200]
    assert replies[0].json() == {
        "status": "error",
        "message": "Failed to add LoRA 'l1': injected load failure",
        "lora_name": "l1",
    }
    assert worker.faults.fail_next_loads == 0
    assert worker.adapters == {"l1": lora_id_for("l1")}


async def test_unload_removes_a_name_containing_a_slash(sim, client, adapter_uri):
    await client.post(f"{W0}/v1/loras", json=load_body("org/run-1/step_2", adapter_uri()))

    reply = await client.delete(f"{W0}/v1/loras/org/run-1/step_2")

    assert reply.status_code == 200
    assert reply.json() == {
        "status": "success",
        "message": "LoRA adapter 'org/run-1/step_2' unloaded successfully",
        "lora_name": "org/run-1/step_2",
        "lora_id": lora_id_for("org/run-1/step_2"),
    }
    assert sim.workers["w000"].adapters == {}


async def test_unload_of_unknown_name_lists_available_in_load_order(client, adapter_uri):
    await client.post(f"{W0}/v1/loras", json=load_body("l2", adapter_uri("b")))
    await client.post(f"{W0}/v1/loras", json=load_body("l1", adapter_uri("a")))

    reply = await client.delete(f"{W0}/v1/loras/nope")

    assert reply.status_code == 500
    assert reply.json() == {
        "status": "error",
        "message": "LoRA adapter 'nope' not found. Available LoRAs: ['l2', 'l1']",
    }


async def test_pause_and_resume_set_the_flag(sim, client):
    worker = sim.workers["w000"]

    paused = await client.post(
        f"{W0}/engine/pause_generation", json={"mode": "keep", "clear_cache": False}
    )
    said = {"status": "ok", "message": "Engine paused", "mode": "keep", "clear_cache": False}
    assert (paused.status_code, paused.json(), worker.paused) == (200, said, True)
    assert paused.headers["content-type"].startswith("text/plain")

    resumed = await client.post(f"{W0}/engine/resume_generation", json={})
    said = {"status": "ok", "message": "Engine resumed"}
    assert (resumed.status_code, resumed.json(), worker.paused) == (200, said, False)


async def test_pause_with_an_unknown_mode_answers_200_with_an_error(sim, client):
    reply = await client.post(f"{W0}/engine/pause_generation", json={"mode": "bogus"})

    assert reply.status_code == 200
    assert reply.json() == {
        "status": "error",
        "message": "Invalid mode 'bogus'; expected keep|wait|abort",
    }
    assert not sim.workers["w000"].paused


async def test_engine_route_body_that_is_not_json_is_400(client):
    reply = await client.post(f"{W0}/engine/pause_generation", content=b"nope")

    assert reply.status_code == 400
    assert reply.json()["error"] == "Invalid JSON"


async def test_unknown_engine_route_is_404(client):
    reply = await client.post(f"{W0}/engine/update_everything", json={})

    assert reply.status_code == 404
    assert reply.json() == {
        "error": "Route not found",
        "message": "Route /engine/update_everything not found",
    }


async def test_unknown_path_is_a_plain_text_404(client):
    reply = await client.get(f"{W0}/no/such/path")

    assert (reply.status_code, reply.text) == (404, "Route not found")


async def test_unknown_worker_is_404(client):
    reply = await client.get("/workers/w999/health")

    assert reply.status_code == 404
    assert reply.json() == {"error": "unknown worker"}


async def test_health_answers_ready(sim, client):
    reply = await client.get(sim.system_url("w001").removeprefix(sim.url) + "/health")

    assert (reply.status_code, reply.json()) == (200, {"status": "ready"})


async def test_bearer_token_is_required_when_api_key_set(secured_sim):
    worker = secured_sim.workers["w000"]
    async with httpx.AsyncClient(base_url=secured_sim.system_url("w000")) as http:
        refused = await http.get("/v1/loras")
        accepted = await http.get("/v1/loras", headers={"Authorization": "Bearer sim-secret"})

    assert (refused.status_code, refused.json()) == (401, {"error": "unauthorized"})
    assert accepted.status_code == 200
    assert [(r.method, r.path) for r in worker.requests] == [("GET", "/v1/loras")] * 2
    assert "authorization" not in worker.requests[0].headers
    assert worker.requests[1].headers["authorization"] == "Bearer sim-secret"


async def test_wrong_bearer_token_is_refused(secured_sim):
    async with httpx.AsyncClient(base_url=secured_sim.system_url("w000")) as http:
        reply = await http.get("/health", headers={"Authorization": "Bearer wrong"})

    assert reply.status_code == 401


async def test_requests_are_recorded_with_parsed_body(sim, client):
    await client.post(f"{W0}/engine/pause_generation", json={"mode": "abort", "clear_cache": True})

    [recorded] = sim.workers["w000"].requests
    assert recorded.method == "POST"
    assert recorded.path == "/engine/pause_generation"
    assert recorded.body == {"mode": "abort", "clear_cache": True}
    assert recorded.headers["content-type"] == "application/json"


async def test_hung_worker_answers_only_after_hang_clears(sim, client):
    worker = sim.workers["w000"]
    worker.set_faults(hang=True)
    held = asyncio.create_task(client.get(f"{W0}/health"))
    try:
        assert await worker.wait_requests(1)
        other = await client.get("/workers/w001/health")
        assert other.status_code == 200
        assert not held.done()

        worker.set_faults(hang=False)
        reply = await asyncio.wait_for(held, 10)
    finally:
        await finish(held)
    assert reply.status_code == 200


async def test_latency_delays_only_its_operation(sim, client, adapter_uri):
    worker = sim.workers["w000"]
    worker.set_faults(latency_s={"load": 60.0})
    slow = asyncio.create_task(client.post(f"{W0}/v1/loras", json=load_body("l1", adapter_uri())))
    try:
        assert await worker.wait_requests(1)
        health = await client.get(f"{W0}/health")
        assert health.status_code == 200
        assert not slow.done()
        assert worker.adapters == {}
    finally:
        await finish(slow)


async def test_load_latency_still_loads(adapter_uri):
    async with (
        SimFleet(["a"], [1], load_latency_s=0.01) as sim,
        httpx.AsyncClient(base_url=sim.system_url("a")) as http,
    ):
        assert sim.workers["a"].faults.latency_s == {"load": 0.01}
        reply = await http.post("/v1/loras", json=load_body("l1", adapter_uri()))

    assert reply.json()["status"] == "success"


async def test_keep_mode_pause_is_refused_while_adapter_requests_run(sim, client):
    worker = sim.workers["w000"]
    worker.set_faults(busy_loras=["b", "a"])

    refused = await client.post(f"{W0}/engine/pause_generation", json={"mode": "keep"})
    waited = await client.post(f"{W0}/engine/pause_generation", json={"mode": "wait"})

    assert (refused.status_code, refused.json()) == (
        200,
        {
            "status": "error",
            "message": "Cannot pause generation in keep mode with active LoRA requests: a, b",
        },
    )
    assert waited.json()["status"] == "ok"
    assert worker.paused and worker.faults.busy_loras == []
