"""A real Dynamo worker killed in the middle of a load fails the update by name.

The fleet is this test's own: its worker w001 takes a minute per load
(``LORA_WORKER_LOAD_DELAY_S``). Once the worker says the load is in progress,
it gets SIGKILL. Its agent lives on and sees the connection drop; the update
must fail naming w001, and the other workers must be resumed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import httpx
import pytest
from conftest import WORLD_SIZES, start_lorabus, worker_state
from processes import Processes
from real_fleet import LOAD_DELAY_ENV, DynamoFleet

from lorabus.client import UpdateClient

pytestmark = pytest.mark.real_dynamo

VICTIM = "w001"
#: Only deadlines, so that a stuck update fails the test instead of hanging it.
LOAD_STARTED_DEADLINE_S = 30.0
RESULT_DEADLINE_S = 90.0


async def wait_load_in_progress(
    http: httpx.AsyncClient, dynamo: DynamoFleet, worker_id: str, name: str
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LOAD_STARTED_DEADLINE_S
    state: dict = {}
    while loop.time() < deadline:
        dynamo.check_alive()
        state = await worker_state(http, dynamo, worker_id)
        if name in state["loading"]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{worker_id} never started loading {name}; last state {state}")


async def test_a_real_worker_killed_mid_load_is_named_in_the_failed_result(
    processes: Processes,
    make_dynamo_fleet: Callable[[Mapping[str, Mapping[str, str]]], DynamoFleet],
    client: UpdateClient,
    http: httpx.AsyncClient,
    nats_url: str,
    make_adapter: Callable[[int], str],
) -> None:
    dynamo = make_dynamo_fleet({VICTIM: {LOAD_DELAY_ENV: "60"}})
    await start_lorabus(processes, dynamo, client, nats_url)

    update = asyncio.create_task(
        client.update("victim", make_adapter(1), version=1, timeout_s=RESULT_DEADLINE_S)
    )
    try:
        await wait_load_in_progress(http, dynamo, VICTIM, "victim-v1")
        dynamo.workers[VICTIM].kill()
        result = await asyncio.wait_for(asyncio.shield(update), RESULT_DEADLINE_S)
    finally:
        update.cancel()

    assert result.status == "failed"
    assert result.error is not None and VICTIM in result.error.message, result.error
    victim = result.workers[VICTIM]
    assert not victim.ok and victim.error is not None, victim
    assert dynamo.system_url(VICTIM) in victim.error.message, victim.error
    for worker_id in WORLD_SIZES:
        if worker_id != VICTIM:
            assert result.workers[worker_id].ok, result.workers[worker_id]
            assert (await worker_state(http, dynamo, worker_id))["paused"] is False, worker_id
