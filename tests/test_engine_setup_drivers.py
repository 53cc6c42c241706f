"""Drivers tell an engine that cannot take LoRA updates from one that refused a call.

vLLM started without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` or without
``VLLM_SERVER_DEV_MODE`` does not serve the LoRA or the pause routes; SGLang
with more than one data-parallel replica fails every LoRA load and unload with
a bare 500; SGLang with ``--admin-api-key`` takes that key, and only that one,
on its control routes. Drivers are built as an agent builds them and run
against the simulated fleet's engines over real HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from lorabus.agents import AgentConfig, SglangDriver, VllmDriver, driver_for
from lorabus.errors import EngineError
from lorabus.service_flags import agent_args
from lorabus.simfleet import SimFleet, SimWorker

Driver = VllmDriver | SglangDriver
API_KEY = "user-key"
ADMIN_KEY = "admin-key"


@pytest.fixture
async def vllm() -> AsyncIterator[SimFleet]:
    async with SimFleet(["w1"], [1], engines=["vllm"]) as fleet:
        yield fleet


@pytest.fixture
async def sglang() -> AsyncIterator[SimFleet]:
    async with SimFleet(["w1"], [1], api_key=API_KEY, engines=["sglang"]) as fleet:
        yield fleet


def _config(sim: SimFleet, kind: str, **settings: object) -> AgentConfig:
    return AgentConfig(
        fleet="f",
        worker_id="w1",
        system_url=sim.system_url("w1"),
        engine=kind,
        engine_timeout_s=5,
        **settings,  # type: ignore[arg-type]
    )


@pytest.fixture
async def make_driver() -> AsyncIterator[Callable[[AgentConfig], Driver]]:
    made: list[Driver] = []

    def make(config: AgentConfig) -> Driver:
        driver = driver_for(config)
        assert isinstance(driver, (VllmDriver, SglangDriver))
        made.append(driver)
        return driver

    yield make
    for driver in made:
        await driver.aclose()


def _worker(sim: SimFleet) -> SimWorker:
    return sim.workers["w1"]


def _calls(worker: SimWorker) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in worker.requests]


def _sglang_keys() -> dict[str, object]:
    """An agent's two keys for the SGLang worker: the API key on every call,
    the admin key in its place on control routes."""
    return {
        "headers": {"Authorization": f"Bearer {API_KEY}"},
        "admin_headers": {"Authorization": f"Bearer {ADMIN_KEY}"},
    }


# -- vLLM started without a flag -----------------------------------------------


async def test_a_vllm_with_every_route_has_no_setup_problem_and_the_check_changes_nothing(
    vllm: SimFleet, make_driver: Callable[[AgentConfig], Driver]
) -> None:
    driver = make_driver(_config(vllm, "vllm"))

    assert await driver.setup_problem() is None

    assert _calls(_worker(vllm)) == [
        ("GET", "/v1/load_lora_adapter"),
        ("GET", "/is_paused"),
        ("GET", "/server_info"),  # its parallel layout: one rank, one API server
    ]
    assert driver.data_parallel == 1
    assert not _worker(vllm).paused and _worker(vllm).adapters == {}


@pytest.mark.parametrize(
    ("flag", "missing", "words"),
    [
        ("lora_updating", "/v1/load_lora_adapter", "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
        ("dev_mode", "/pause", "VLLM_SERVER_DEV_MODE=1"),
    ],
)
async def test_a_vllm_started_without_a_flag_is_told_by_the_route_it_lacks(
    flag: str,
    missing: str,
    words: str,
    vllm: SimFleet,
    make_driver: Callable[[AgentConfig], Driver],
) -> None:
    _worker(vllm).set_setup(**{flag: False})
    driver = make_driver(_config(vllm, "vllm"))

    problem = await driver.setup_problem()

    assert problem == f"vLLM at {driver.base_url} serves no {missing}: start it with {words}"


async def test_a_vllm_without_either_flag_is_told_both(
    vllm: SimFleet, make_driver: Callable[[AgentConfig], Driver]
) -> None:
    _worker(vllm).set_setup(lora_updating=False, dev_mode=False)
    driver = make_driver(_config(vllm, "vllm"))

    problem = await driver.setup_problem()

    assert problem is not None
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in problem
    assert "VLLM_SERVER_DEV_MODE=1" in problem


async def test_a_load_on_a_vllm_without_its_lora_routes_fails_at_once_saying_how_to_turn_them_on(
    vllm: SimFleet,
    make_driver: Callable[[AgentConfig], Driver],
    make_adapter: Callable[[int], str],
) -> None:
    _worker(vllm).set_setup(lora_updating=False)
    driver = make_driver(_config(vllm, "vllm"))

    with pytest.raises(EngineError) as raised:
        await driver.load_adapter("p", make_adapter(1), budget_s=10)

    message = str(raised.value)
    assert "answered 404" in message and "not retried" in message, message
    assert "serves no /v1/load_lora_adapter" in message, message
    assert "start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in message, message
    assert not raised.value.retryable
    assert _worker(vllm).loads_received == 1


async def test_a_pause_on_a_vllm_without_dev_mode_fails_saying_how_to_turn_it_on(
    vllm: SimFleet, make_driver: Callable[[AgentConfig], Driver]
) -> None:
    _worker(vllm).set_setup(dev_mode=False)
    driver = make_driver(_config(vllm, "vllm"))

    with pytest.raises(EngineError, match="start it with VLLM_SERVER_DEV_MODE=1") as raised:
        await driver.pause()

    assert raised.value.status == 404 and not raised.value.retryable


async def test_vllms_own_404_for_a_directory_without_an_adapter_is_not_taken_for_a_missing_route(
    vllm: SimFleet,
    make_driver: Callable[[AgentConfig], Driver],
) -> None:
    driver = make_driver(_config(vllm, "vllm"))

    with pytest.raises(EngineError) as raised:
        await driver.load_adapter("p", "/nowhere/step_7", budget_s=10)

    assert "No adapter found for" in str(raised.value)
    assert "serves no" not in str(raised.value)


# -- SGLang with data parallelism ---------------------------------------------------


async def test_a_load_on_a_data_parallel_sglang_is_final_and_says_it_needs_one_replica(
    sglang: SimFleet,
    make_driver: Callable[[AgentConfig], Driver],
    make_adapter: Callable[[int], str],
) -> None:
    _worker(sglang).set_setup(dp_size=2)
    driver = make_driver(_config(sglang, "sglang", headers={"Authorization": f"Bearer {API_KEY}"}))

    with pytest.raises(EngineError) as raised:
        await driver.load_adapter("p", make_adapter(1), budget_s=10)

    message = str(raised.value)
    assert "answered 500: Internal Server Error" in message, message
    assert "runs 2 data-parallel replicas" in message, message
    assert "start it with --dp-size 1" in message and "not retried" in message, message
    assert not raised.value.retryable
    assert _worker(sglang).loads_received == 1
    assert await driver.setup_problem() is not None


async def test_a_bare_500_from_sglang_with_one_replica_is_still_retried(
    sglang: SimFleet,
    make_driver: Callable[[AgentConfig], Driver],
    make_adapter: Callable[[int], str],
) -> None:
    _worker(sglang).set_faults(fail_next_loads=1, load_failure_status=500)
    driver = make_driver(_config(sglang, "sglang", headers={"Authorization": f"Bearer {API_KEY}"}))

    await driver.load_adapter("p", make_adapter(1), budget_s=10)

    assert _worker(sglang).loads_received == 2
    assert await driver.setup_problem() is None
    assert ("GET", "/server_info") in _calls(_worker(sglang))


# -- SGLang with two keys -----------------------------------------------------------


async def test_with_both_keys_sglang_gets_the_admin_key_on_control_routes_and_the_api_key_else(
    sglang: SimFleet,
    make_driver: Callable[[AgentConfig], Driver],
    make_adapter: Callable[[int], str],
) -> None:
    worker = _worker(sglang)
    worker.set_setup(admin_api_key=ADMIN_KEY)
    driver = make_driver(_config(sglang, "sglang", **_sglang_keys()))
    path = make_adapter(1)

    await driver.pause()
    await driver.load_adapter("p", path, budget_s=5)
    listed = await driver.list_adapters()
    await driver.unload_adapter("p")
    await driver.resume()

    assert listed == ["p"] and worker.adapters == {} and not worker.paused
    keys = [(r.method, r.path, r.headers["authorization"]) for r in worker.requests]
    assert keys == [
        ("POST", "/pause_generation", f"Bearer {ADMIN_KEY}"),
        ("POST", "/load_lora_adapter", f"Bearer {ADMIN_KEY}"),
        ("GET", "/v1/models", f"Bearer {API_KEY}"),
        ("POST", "/unload_lora_adapter", f"Bearer {ADMIN_KEY}"),
        ("POST", "/continue_generation", f"Bearer {ADMIN_KEY}"),
    ]


@pytest.mark.parametrize("sent", ["api key everywhere", "admin key everywhere"])
async def test_one_key_everywhere_is_refused_by_an_sglang_with_both(
    sent: str,
    sglang: SimFleet,
    make_driver: Callable[[AgentConfig], Driver],
    make_adapter: Callable[[int], str],
) -> None:
    _worker(sglang).set_setup(admin_api_key=ADMIN_KEY)
    key = API_KEY if sent == "api key everywhere" else ADMIN_KEY
    driver = make_driver(_config(sglang, "sglang", headers={"Authorization": f"Bearer {key}"}))

    with pytest.raises(EngineError, match="401") as raised:
        if key == API_KEY:
            await driver.load_adapter("p", make_adapter(1), budget_s=10)
        else:
            await driver.list_adapters()

    assert raised.value.status == 401 and not raised.value.retryable
    assert len(_worker(sglang).requests) == 1


def test_an_admin_key_is_refused_for_engines_without_one_and_kept_off_command_lines() -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for kind in ("vllm", "dynamo"):
        with pytest.raises(ValueError, match="--admin-api-key"):
            AgentConfig(
                fleet="f", worker_id="w1", system_url="http://e", engine=kind, admin_headers=admin
            )
    config = AgentConfig(
        fleet="f", worker_id="w1", system_url="http://e", engine="sglang", admin_headers=admin
    )
    with pytest.raises(ValueError, match="--admin-api-key-env"):
        agent_args(config, nats_url="nats://n")
