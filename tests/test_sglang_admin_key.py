"""An SGLang started with both ``--api-key`` and ``--admin-api-key`` updates through
``lorabus agent --api-key-env VAR --admin-api-key-env VAR``.

SGLang takes only the admin key on its control routes (pause, continue, load,
unload) and only the API key on ``/v1/models``: one key everywhere fails
either way. Real NATS, a real ``lorabus coordinator`` and real ``lorabus
agent --engine sglang`` processes, configured as an operator would, against
simulated SGLang workers that check both keys as SGLang does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from processes import Processes, wait_live_workers

from lorabus.agents import AgentConfig
from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from lorabus.simfleet import SimFleet

API_KEY, ADMIN_KEY = "user-key", "admin-key"
KEY_VAR, ADMIN_VAR = "SGLANG_KEY", "SGLANG_ADMIN_KEY"
WORLD_SIZES = {"w000": 1, "w001": 2}
CONTROL = {"/pause_generation", "/continue_generation", "/load_lora_adapter"}


async def test_an_update_commits_with_the_admin_key_on_control_routes_and_the_api_key_else(
    processes: Processes,
    client: UpdateClient,
    nats_url: str,
    fleet_name: str,
    start_sim: Callable[..., Awaitable[SimFleet]],
    make_adapter: Callable[[int], str],
) -> None:
    sim = await start_sim(WORLD_SIZES, api_key=API_KEY, engines=["sglang"])
    for worker in sim.workers.values():
        worker.set_setup(admin_api_key=ADMIN_KEY)
    coordinator = CoordinatorConfig(
        fleet=fleet_name,
        frontend_url=sim.url,
        expected_world_size=sum(WORLD_SIZES.values()),
        phase_timeout_s=10,
        verify_timeout_s=10,
    )
    await processes.start_coordinator(
        coordinator, nats_url=nats_url, extra=["--api-key-env", KEY_VAR], env={KEY_VAR: API_KEY}
    )
    for worker_id, world_size in WORLD_SIZES.items():
        config = AgentConfig(
            fleet=fleet_name,
            worker_id=worker_id,
            system_url=sim.system_url(worker_id),
            world_size=world_size,
            engine="sglang",
            heartbeat_s=0.2,
        )
        await processes.start_agent(
            config,
            nats_url=nats_url,
            extra=["--api-key-env", KEY_VAR, "--admin-api-key-env", ADMIN_VAR],
            env={KEY_VAR: API_KEY, ADMIN_VAR: ADMIN_KEY},
        )
    await wait_live_workers(client, WORLD_SIZES, processes=processes)

    result = await client.update("policy", make_adapter(1), version=1, timeout_s=30)

    assert result.committed, result.error
    for worker_id, worker in sim.workers.items():
        assert "policy-v1" in worker.adapters and not worker.paused, worker_id
        sent = {(r.path, r.headers.get("authorization")) for r in worker.requests}
        assert {path for path, _ in sent} >= CONTROL | {"/v1/models"}, (worker_id, sent)
        for path, authorization in sent:
            key = ADMIN_KEY if path in CONTROL | {"/unload_lora_adapter"} else API_KEY
            assert authorization == f"Bearer {key}", (worker_id, path, authorization)
