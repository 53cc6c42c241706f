"""The real frontend, configured as the README says, routes an adapter only to its holders,
and an agent's canary to its own worker.

The shared fleet's frontend runs with ``DYN_LORA_ENABLED=true
DYN_LORA_ALLOCATION_ENABLED=false --router-mode kv``. An adapter is
loaded on w001 alone (straight on its system server, no lorabus); every chat
completion for it must be served by w001. Which worker served a request is read from the
workers' own logs, where the runtime logs each request id it receives on its
``generate`` endpoint (the frontend's completion id carries the same id).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest
from conftest import WORLD_SIZES, frontend_models
from real_fleet import BASE_MODEL, DynamoFleet

from lorabus.agents import DynamoDriver
from lorabus.errors import CanaryFailed

pytestmark = pytest.mark.real_dynamo

HOLDER = "w001"
REQUESTS = 6
DEADLINE_S = 20.0


async def chat(http: httpx.AsyncClient, dynamo: DynamoFleet, model: str) -> str:
    """One chat completion; returns the request id the frontend gave it."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    reply = await http.post(f"{dynamo.frontend_url}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    completion_id: str = reply.json()["id"]
    return completion_id.removeprefix("chatcmpl-")


async def served_by(dynamo: DynamoFleet, request_id: str) -> set[str]:
    """The workers whose logs show ``request_id`` arriving on ``generate``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while True:
        found = set()
        for worker_id, worker in dynamo.workers.items():
            for line in worker.log_path.read_text(errors="replace").splitlines():
                if request_id in line and '"generate"' in line:
                    found.add(worker_id)
        if found or loop.time() > deadline:
            return found
        await asyncio.sleep(0.05)


async def wait_listed(http: httpx.AsyncClient, dynamo: DynamoFleet, name: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while name not in await frontend_models(http, dynamo):
        assert loop.time() < deadline, f"the frontend never listed {name}"
        await asyncio.sleep(0.05)


async def test_adapter_requests_reach_only_the_worker_that_loaded_it(
    dynamo: DynamoFleet, http: httpx.AsyncClient, make_adapter: Callable[[int], str]
) -> None:
    name = "routed-v1"
    holder_url = dynamo.system_url(HOLDER)
    load = {"lora_name": name, "source": {"uri": f"file://{make_adapter(1)}"}}
    loaded = await http.post(f"{holder_url}/v1/loras", json=load)
    assert loaded.status_code == 200, loaded.text
    try:
        await wait_listed(http, dynamo, name)

        adapter_ids = [await chat(http, dynamo, name) for _ in range(REQUESTS)]
        base_ids = [await chat(http, dynamo, BASE_MODEL) for _ in range(REQUESTS)]

        for request_id in adapter_ids:
            assert await served_by(dynamo, request_id) == {HOLDER}, request_id
        # The KV router picks a worker by cache overlap: the base model may
        # stay on one, but each request is served once.
        for request_id in base_ids:
            servers = await served_by(dynamo, request_id)
            assert len(servers) == 1, (request_id, servers)
    finally:
        await http.delete(f"{holder_url}/v1/loras/{name}")


async def test_an_agents_canary_is_answered_by_its_own_worker(
    dynamo: DynamoFleet, http: httpx.AsyncClient, make_adapter: Callable[[int], str]
) -> None:
    """The agent's canary goes through the real frontend (``--router-mode kv``)
    with ``nvext.backend_instance_id``, found in ``/v1/rl/workers`` by the
    worker's system URL, and is answered by that worker: the answer's
    ``nvext.worker_id`` says so, and the driver checks it."""
    name = "canary-v1"
    load = {"lora_name": name, "source": {"uri": f"file://{make_adapter(1)}"}}
    for worker_id in WORLD_SIZES:
        loaded = await http.post(f"{dynamo.system_url(worker_id)}/v1/loras", json=load)
        assert loaded.status_code == 200, loaded.text
    drivers = [
        DynamoDriver(
            dynamo.system_url(worker_id),
            frontend_url=dynamo.frontend_url,
            discovery_url=dynamo.rl_url,
        )
        for worker_id in WORLD_SIZES
    ]
    try:
        await wait_listed(http, dynamo, name)
        for driver in drivers:
            await driver.canary(name, budget_s=DEADLINE_S)
    finally:
        for driver in drivers:
            await driver.aclose()
        for worker_id in WORLD_SIZES:
            await http.delete(f"{dynamo.system_url(worker_id)}/v1/loras/{name}")


async def test_a_canary_the_router_sends_to_another_worker_fails_saying_why(
    make_dynamo_fleet: Callable[..., DynamoFleet],
    http: httpx.AsyncClient,
    make_adapter: Callable[[int], str],
) -> None:
    """Dynamo 1.6.1's round-robin router ignores ``backend_instance_id``: with
    the adapter on w001 alone, w000's canary is answered by w001, which proves
    nothing of w000, so it fails, naming the router mode that routes it."""
    fleet = make_dynamo_fleet({}, router_mode="round-robin")
    name = "canary-v1"
    load = {"lora_name": name, "source": {"uri": f"file://{make_adapter(1)}"}}
    loaded = await http.post(f"{fleet.system_url(HOLDER)}/v1/loras", json=load)
    assert loaded.status_code == 200, loaded.text
    driver = DynamoDriver(
        fleet.system_url("w000"), frontend_url=fleet.frontend_url, discovery_url=fleet.rl_url
    )
    try:
        await wait_listed(http, fleet, name)
        with pytest.raises(CanaryFailed, match="--router-mode kv"):
            await driver.canary(name, budget_s=DEADLINE_S)
    finally:
        await driver.aclose()
