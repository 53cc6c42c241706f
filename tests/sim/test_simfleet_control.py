"""The /sim control API and the fleet's lifecycle and construction rules."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from lorabus import simfleet
from lorabus.simfleet import SimFleet, serve_forever


async def test_control_lists_worker_states(client):
    states = (await client.get("/sim/workers")).json()

    assert [s["worker_id"] for s in states] == ["w000", "w001", "w002"]
    assert states[1] == {
        "worker_id": "w001",
        "instance_id": simfleet.instance_id_for("w001"),
        "world_size": 2,
        "engine": "dynamo",
        "role": "aggregated",
        "paused": False,
        "adapters": [],
        "faults": {
            "latency_s": {},
            "fail_next_loads": 0,
            "load_failure_status": 500,
            "fail_next_unloads": 0,
            "hang": False,
            "status_error_quirk": False,
            "busy_loras": [],
            "unroutable": [],
            "load_misses_ranks": [],
        },
    }


async def test_control_sets_faults_on_one_worker(sim, client):
    reply = await client.put(
        "/sim/workers/w002/faults", json={"fail_next_loads": 3, "latency_s": {"load": 0.5}}
    )

    assert reply.status_code == 200
    assert reply.json()["faults"]["fail_next_loads"] == 3
    assert sim.workers["w002"].faults.latency_s == {"load": 0.5}
    assert sim.workers["w001"].faults.fail_next_loads == 0


async def test_control_rejects_bad_faults(client):
    for body in ({"hang": "yes"}, {"nonsense": 1}, {"latency_s": {"teleport": 1}}):
        reply = await client.put("/sim/workers/w000/faults", json=body)
        assert reply.status_code == 400, body


async def test_control_clears_hang_and_releases_held_request(sim, client):
    worker = sim.workers["w000"]
    await client.put("/sim/workers/w000/faults", json={"hang": True})
    held = asyncio.create_task(client.get("/workers/w000/v1/loras"))
    try:
        assert await worker.wait_requests(1)
        assert not held.done()

        await client.put("/sim/workers/w000/faults", json={"hang": False})
        reply = await asyncio.wait_for(held, 10)
    finally:
        held.cancel()
        await asyncio.wait([held])
    assert reply.json()["status"] == "success"


async def test_control_returns_recorded_requests(client):
    await client.post("/workers/w000/engine/pause_generation", json={"mode": "wait"})

    [recorded] = (await client.get("/sim/workers/w000/requests")).json()

    assert recorded["method"] == "POST"
    assert recorded["path"] == "/engine/pause_generation"
    assert recorded["body"] == {"mode": "wait"}
    assert isinstance(recorded["ts"], float)


async def test_control_for_unknown_worker_is_404(client):
    reply = await client.get("/sim/workers/nope")

    assert (reply.status_code, reply.json()) == (404, {"error": "unknown worker"})


async def test_control_needs_no_bearer_token(secured_sim):
    async with httpx.AsyncClient(base_url=secured_sim.url) as http:
        reply = await http.get("/sim/workers")

    assert reply.status_code == 200


async def test_stop_releases_hung_requests_and_is_idempotent(sim, client):
    worker = sim.workers["w000"]
    worker.set_faults(hang=True)
    held = asyncio.create_task(client.get("/workers/w000/health"))
    try:
        assert await worker.wait_requests(1)

        await sim.stop()
        await sim.stop()
        reply = await asyncio.wait_for(held, 10)
    finally:
        held.cancel()
        await asyncio.wait([held])
    assert reply.status_code == 503


async def test_serve_forever_reports_ready_and_stops_when_cancelled():
    sim = SimFleet(["a"], [1])
    ready = asyncio.Event()
    serving = asyncio.create_task(serve_forever(sim, "127.0.0.1", 0, lambda f: ready.set()))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        async with httpx.AsyncClient(base_url=sim.url) as http:
            assert (await http.get("/workers/a/health")).status_code == 200
    finally:
        serving.cancel()
        await asyncio.wait([serving])
    assert serving.cancelled()
    with pytest.raises(RuntimeError):
        await sim.start()


def test_of_size_pads_ids_and_cycles_world_sizes():
    sim = SimFleet.of_size(4, world_sizes=(1, 2, 4))

    assert list(sim.workers) == ["w000", "w001", "w002", "w003"]
    assert [w.world_size for w in sim.workers.values()] == [1, 2, 4, 1]
    assert list(SimFleet.of_size(1001).workers)[-1] == "w1000"


@pytest.mark.parametrize(
    ("ids", "sizes"),
    [(["a", "b"], [1]), (["a", "a"], [1, 1]), (["a"], [0]), (["a/b"], [1])],
)
def test_invalid_fleet_is_rejected(ids, sizes):
    with pytest.raises(ValueError):
        SimFleet(ids, sizes)


def test_url_before_start_is_an_error():
    with pytest.raises(RuntimeError):
        _ = SimFleet(["a"], [1]).url


def test_instance_ids_are_deterministic_unsigned_64_bit():
    ids = [SimFleet.of_size(8).workers[f"w00{i}"].instance_id for i in range(8)]

    assert ids == [SimFleet.of_size(8).workers[f"w00{i}"].instance_id for i in range(8)]
    assert all(0 <= i < 2**64 for i in ids)
    assert any(i >= 2**63 for i in ids), "real ids use the top bit too"


def test_public_names_are_exported():
    for name in simfleet.__all__:
        assert getattr(simfleet, name) is not None
