"""A thousand simulated workers fit in one process on one port."""

from __future__ import annotations

import httpx

from lorabus.simfleet import SimFleet


async def test_thousand_workers_answer_on_one_port(tmp_path):
    adapter = tmp_path / "l1"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    body = {"lora_name": "l1", "source": {"uri": f"file://{adapter}"}}

    async with (
        SimFleet.of_size(1000) as sim,
        httpx.AsyncClient(base_url=sim.url, timeout=30.0) as http,
    ):
        health = await http.get("/workers/w999/health")
        discovery = (await http.get("/v1/rl/workers")).json()
        # One after another: httpx's pool slows down badly with ~1000 queued
        # requests, which would measure the client instead of the sim.
        loads = [await http.post(f"/workers/{w}/v1/loras", json=body) for w in sim.workers]

    assert (health.status_code, health.json()) == (200, {"status": "ready"})
    assert len(discovery["workers"]) == 1000
    assert discovery["workers"][-1]["system_url"] == sim.system_url("w999")
    assert all(r.json()["status"] == "success" for r in loads)
    assert all("l1" in w.adapters for w in sim.workers.values())
