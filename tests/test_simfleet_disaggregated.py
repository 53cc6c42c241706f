"""The simulated frontend runs each request on a prefill and a decode worker once
the fleet has prefill workers, as Dynamo's disaggregated serving does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from lorabus.simfleet import SimFleet

CANARY = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
WORKER_IDS = {"extra_fields": ["worker_id"]}


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    """w000 prefill, w001 decode, w002 prefill, w003 decode."""
    async with SimFleet.of_size(4, roles=("prefill", "decode")) as started:
        yield started


@pytest.fixture
async def http(fleet: SimFleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fleet.url, timeout=10) as client:
        yield client


def ids(fleet: SimFleet, prefill: str, decode: str) -> dict[str, Any]:
    return {
        "worker_id": {
            "prefill_worker_id": fleet.workers[prefill].instance_id,
            "decode_worker_id": fleet.workers[decode].instance_id,
        }
    }


def completions_by_worker(fleet: SimFleet) -> dict[str, int]:
    return {
        w.worker_id: w.count_requests("POST", "/v1/completions") for w in fleet.workers.values()
    }


async def complete(http: httpx.AsyncClient, model: str, **nvext: Any) -> httpx.Response:
    return await http.post("/v1/completions", json={**CANARY, "model": model, "nvext": nvext})


async def test_discovery_lists_prefill_workers_under_the_prefill_component(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    entries = (await http.get("/v1/rl/workers")).json()["workers"]

    assert [e["component"] for e in entries] == ["prefill", "backend", "prefill", "backend"]
    prefill = entries[0]
    assert prefill["request_plane_url"] == "dyn://dynamo.prefill.rl"
    assert prefill["transport"]["tcp"].endswith(
        f"/{fleet.workers['w000'].instance_id:016x}/dynamo/prefill/rl"
    )
    assert entries[1]["request_plane_url"] == "dyn://dynamo.backend.rl"
    assert set(prefill) == set(entries[1])


async def test_a_completion_runs_on_a_prefill_and_a_decode_worker_that_both_hold_the_model(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    for worker_id in ("w002", "w001"):
        fleet.workers[worker_id].add_adapter("a", "/adapters/a")

    reply = await complete(http, "a", **WORKER_IDS)

    assert reply.status_code == 200
    assert reply.json()["nvext"] == ids(fleet, "w002", "w001")
    assert reply.json()["choices"][0]["text"] == "simulated reply from worker w001 using model a"
    assert reply.headers["x-served-by"] == "w001"
    assert completions_by_worker(fleet) == {"w000": 0, "w001": 1, "w002": 1, "w003": 0}


async def test_a_model_only_one_side_holds_is_not_found(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    fleet.workers["w001"].add_adapter("decode-only", "/adapters/d")
    fleet.workers["w000"].add_adapter("prefill-only", "/adapters/p")

    replies = [await complete(http, name) for name in ("decode-only", "prefill-only")]

    assert [(r.status_code, r.json()) for r in replies] == [
        (404, {"message": "Model not found", "type": "Not Found", "code": 404})
    ] * 2
    assert sum(completions_by_worker(fleet).values()) == 0


async def test_without_targets_each_side_takes_its_holders_in_turn(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    replies = [await complete(http, "sim-base", **WORKER_IDS) for _ in range(3)]

    assert [r.json()["nvext"] for r in replies] == [
        ids(fleet, "w000", "w001"),
        ids(fleet, "w002", "w003"),
        ids(fleet, "w000", "w001"),
    ]


async def test_a_request_runs_on_exactly_the_workers_it_names(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    prefill, decode = fleet.workers["w002"], fleet.workers["w001"]

    named = [
        await complete(
            http,
            "sim-base",
            prefill_worker_id=prefill.instance_id,
            decode_worker_id=decode.instance_id,
            **WORKER_IDS,
        )
        for _ in range(2)
    ]
    by_backend_id = await complete(
        http, "sim-base", backend_instance_id=fleet.workers["w003"].instance_id, **WORKER_IDS
    )
    decode_id_first = await complete(
        http,
        "sim-base",
        decode_worker_id=decode.instance_id,
        backend_instance_id=fleet.workers["w003"].instance_id,
        **WORKER_IDS,
    )

    assert [r.json()["nvext"] for r in named] == [ids(fleet, "w002", "w001")] * 2
    assert by_backend_id.json()["nvext"]["worker_id"]["decode_worker_id"] == (
        fleet.workers["w003"].instance_id
    )
    assert decode_id_first.json()["nvext"]["worker_id"]["decode_worker_id"] == decode.instance_id


async def test_a_named_worker_that_lacks_the_model_or_the_role_is_refused(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    for worker_id in ("w000", "w001"):
        fleet.workers[worker_id].add_adapter("a", "/adapters/a")
    prefill_lacks = fleet.workers["w002"].instance_id
    decode_lacks = fleet.workers["w003"].instance_id

    no_prefill = await complete(http, "a", prefill_worker_id=prefill_lacks)
    no_decode = await complete(http, "a", decode_worker_id=decode_lacks)
    wrong_role = await complete(http, "a", decode_worker_id=fleet.workers["w000"].instance_id)
    unknown = await complete(http, "a", prefill_worker_id=7)

    assert (no_prefill.status_code, no_prefill.json()["message"]) == (404, "Model not found")
    assert (no_decode.status_code, no_decode.json()["message"]) == (404, "Model not found")
    assert wrong_role.status_code == 404
    assert wrong_role.json()["message"] == (
        f"No decode worker with instance id {fleet.workers['w000'].instance_id}"
    )
    assert (unknown.status_code, unknown.json()["message"]) == (
        404,
        "No prefill worker with instance id 7",
    )


async def test_an_adapter_unroutable_on_the_prefill_worker_is_not_found(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    for worker_id in ("w000", "w001"):
        fleet.workers[worker_id].add_adapter("a", "/adapters/a")
    fleet.workers["w000"].set_faults(unroutable=["a"])

    reply = await complete(http, "a")

    assert (reply.status_code, reply.json()["message"]) == (404, "Model not found")
    assert completions_by_worker(fleet) == {"w000": 1, "w001": 1, "w002": 0, "w003": 0}


async def test_a_request_is_held_while_its_prefill_worker_is_paused(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    prefill = fleet.workers["w000"]
    await http.post("/workers/w000/engine/pause_generation", json={"mode": "keep"})
    body = {
        **CANARY,
        "model": "sim-base",
        "nvext": {"prefill_worker_id": prefill.instance_id, **WORKER_IDS},
    }
    held = asyncio.ensure_future(http.post("/v1/completions", json=body))
    try:
        assert await prefill.wait_until(lambda: prefill.waiting_for_resume == 1)
        assert not held.done()
        await http.post("/workers/w000/engine/resume_generation", json={})
        reply = await asyncio.wait_for(held, 10)
    finally:
        held.cancel()
        await asyncio.wait([held])

    assert reply.status_code == 200
    assert reply.json()["nvext"]["worker_id"]["prefill_worker_id"] == prefill.instance_id


async def test_a_chat_is_disaggregated_too(fleet: SimFleet, http: httpx.AsyncClient) -> None:
    body = {"model": "sim-base", "messages": [], "nvext": WORKER_IDS}

    reply = await http.post("/v1/chat/completions", json=body)

    assert reply.json()["served_by"] == "w001"
    assert reply.json()["nvext"] == ids(fleet, "w000", "w001")


async def test_an_aggregated_request_names_its_one_worker_as_both_when_asked() -> None:
    async with (
        SimFleet.of_size(2) as fleet,
        httpx.AsyncClient(base_url=fleet.url, timeout=10) as http,
    ):
        asked = await complete(http, "sim-base", **WORKER_IDS)
        chat = await http.post(
            "/v1/chat/completions", json={"model": "sim-base", "messages": [], "nvext": WORKER_IDS}
        )
        not_asked = await complete(http, "sim-base")

    assert asked.json()["nvext"] == ids(fleet, "w000", "w000")
    assert chat.json()["nvext"] == ids(fleet, "w001", "w001")
    assert "nvext" not in not_asked.json()
    assert completions_by_worker(fleet) == {"w000": 2, "w001": 0}


@pytest.mark.parametrize("roles", [(), ("encode",)])
def test_the_fleet_refuses_an_unknown_role(roles: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="role"):
        SimFleet.of_size(2, roles=roles)
