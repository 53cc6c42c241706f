"""The Dynamo driver sends exactly the documented requests and reads answers strictly."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from lorabus.agents import AgentConfig, DynamoDriver
from lorabus.errors import BadRequest, EngineError
from lorabus.simfleet import SimFleet


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    async with SimFleet(["w1"], [2], api_key="k") as fleet:
        yield fleet


@pytest.fixture
async def driver(sim: SimFleet) -> AsyncIterator[DynamoDriver]:
    engine = DynamoDriver(sim.system_url("w1"), headers={"Authorization": "Bearer k"}, timeout_s=5)
    yield engine
    await engine.aclose()


def _calls(sim: SimFleet) -> list[tuple[str, str, object]]:
    return [(r.method, r.path, r.body) for r in sim.workers["w1"].requests]


async def test_pause_load_list_unload_resume_use_dynamos_routes_and_bodies(
    sim: SimFleet, driver: DynamoDriver, make_adapter: Callable[[int], str]
) -> None:
    path = make_adapter(1)
    await driver.pause()
    await driver.load_adapter("org/policy-v1", path, budget_s=5)
    listed = await driver.list_adapters()
    await driver.unload_adapter("org/policy-v1")
    await driver.resume()

    assert listed == ["org/policy-v1"]
    assert _calls(sim) == [
        ("POST", "/engine/pause_generation", {"mode": "keep", "clear_cache": False}),
        (
            "POST",
            "/v1/loras",
            {"lora_name": "org/policy-v1", "source": {"uri": Path(path).as_uri()}},
        ),
        ("GET", "/v1/loras", None),
        ("DELETE", "/v1/loras/org/policy-v1", None),
        ("POST", "/engine/resume_generation", {}),
    ]
    # One segment on the wire; Dynamo's {*lora_name} route decodes it back.
    assert sim.workers["w1"].requests[3].raw_path == "/v1/loras/org%2Fpolicy-v1"


@pytest.mark.parametrize(
    ("name", "wire"),
    [
        ("a/../../engine/pause_generation", "a%2F..%2F..%2Fengine%2Fpause_generation"),
        ("p?mode=abort", "p%3Fmode%3Dabort"),
        ("p#frag", "p%23frag"),
        ("p%2F..%2Fx", "p%252F..%252Fx"),
        ("...", "..."),
    ],
)
async def test_an_unload_reaches_only_the_unload_route_of_that_exact_name(
    sim: SimFleet, driver: DynamoDriver, name: str, wire: str
) -> None:
    worker = sim.workers["w1"]
    worker.add_adapter(name)
    worker.add_adapter("bystander")

    await driver.unload_adapter(name)

    assert [(r.method, r.raw_path) for r in worker.requests] == [("DELETE", f"/v1/loras/{wire}")]
    assert list(worker.adapters) == ["bystander"]
    assert not worker.paused


@pytest.mark.parametrize("name", ["..", ".", ""])
async def test_a_name_a_client_would_resolve_away_is_never_sent(
    sim: SimFleet, driver: DynamoDriver, name: str
) -> None:
    # DELETE /v1/loras/.. is DELETE /v1 once a client or server resolves it: another route.
    with pytest.raises(BadRequest, match="URL path segment"):
        await driver.unload_adapter(name)

    assert sim.workers["w1"].requests == []


async def test_http_200_with_status_error_is_a_failure(
    sim: SimFleet, driver: DynamoDriver, tmp_path: Path
) -> None:
    sim.workers["w1"].set_faults(status_error_quirk=True)

    with pytest.raises(EngineError, match="answered 200 with an error"):
        await driver.load_adapter("p", str(tmp_path / "missing"), budget_s=0.5)


async def test_a_server_error_is_retried_until_the_load_succeeds(
    sim: SimFleet, driver: DynamoDriver, make_adapter: Callable[[int], str]
) -> None:
    sim.workers["w1"].set_faults(fail_next_loads=3)

    await driver.load_adapter("p", make_adapter(1), budget_s=10)

    assert [c[:2] for c in _calls(sim)] == [("POST", "/v1/loras")] * 4


async def test_a_client_error_other_than_404_is_not_retried(sim: SimFleet) -> None:
    unauthenticated = DynamoDriver(sim.system_url("w1"), timeout_s=5)
    try:
        with pytest.raises(EngineError, match="401") as raised:
            await unauthenticated.load_adapter("p", "/nowhere", budget_s=10)
    finally:
        await unauthenticated.aclose()

    assert raised.value.status == 401 and not raised.value.retryable
    assert len(sim.workers["w1"].requests) == 1


async def test_an_unreachable_engine_is_a_retryable_engine_error() -> None:
    engine = DynamoDriver("http://127.0.0.1:9", timeout_s=1)
    try:
        with pytest.raises(EngineError, match="failed: ConnectError") as raised:
            await engine.pause()
    finally:
        await engine.aclose()
    assert raised.value.retryable


async def test_a_refused_keep_mode_pause_is_retried_in_wait_mode(
    sim: SimFleet, driver: DynamoDriver
) -> None:
    # Dynamo 1.6.1's vLLM handler refuses `keep` while adapter requests run.
    worker = sim.workers["w1"]
    worker.set_faults(busy_loras=["policy-v1"])

    await driver.pause()

    assert worker.paused
    assert [r.body for r in worker.requests] == [
        {"mode": "keep", "clear_cache": False},
        {"mode": "wait", "clear_cache": False},
    ]


async def test_an_engine_route_answering_200_with_an_error_is_a_failure(sim: SimFleet) -> None:
    # Real /engine/* routes report a failed handler as HTTP 200 + "status": "error".
    engine = DynamoDriver(sim.system_url("w1"), headers={"Authorization": "Bearer k"}, timeout_s=5)
    try:
        with pytest.raises(EngineError, match="answered 200 with an error: Invalid mode"):
            await engine._call("POST", "/engine/pause_generation", {"mode": "bogus"})
    finally:
        await engine.aclose()
    assert not sim.workers["w1"].paused


async def test_headers_the_configuration_sets_are_sent_once_in_place_of_the_clients_own(
    sim: SimFleet,
) -> None:
    engine = DynamoDriver(
        sim.system_url("w1"),
        headers={"Authorization": "Bearer k", "host": "engine.internal", "User-Agent": "rl/1"},
        timeout_s=5,
    )
    try:
        await engine.pause()
    finally:
        await engine.aclose()

    (request,) = sim.workers["w1"].requests
    assert request.headers["host"] == "engine.internal"
    assert request.headers["user-agent"] == "rl/1"


async def test_a_user_and_password_in_the_engine_url_are_basic_auth_and_never_shown(
    make_adapter: Callable[[int], str],
) -> None:
    async with SimFleet(["w1"], [2]) as fleet:
        url = fleet.system_url("w1").replace("http://", "http://rl%40team:s3cr%3At@", 1)
        engine = DynamoDriver(url, timeout_s=5)
        try:
            await engine.pause()
            fleet.workers["w1"].set_faults(fail_next_loads=1, load_failure_status=400)
            with pytest.raises(EngineError, match="answered 400") as raised:
                await engine.load_adapter("p", make_adapter(1), budget_s=5)
        finally:
            await engine.aclose()
        requests = fleet.workers["w1"].requests

    assert {r.headers["authorization"] for r in requests} == {
        "Basic " + base64.b64encode(b"rl@team:s3cr:t").decode()
    }
    assert requests[0].headers["user-agent"].startswith("lorabus/")
    assert "s3cr" not in str(raised.value) and "s3cr" not in engine.system_url


def test_an_engine_url_that_is_not_ascii_is_refused_when_configured() -> None:
    with pytest.raises(ValueError, match="must be ASCII"):
        AgentConfig(fleet="f", worker_id="w1", system_url="http://moteur.exemple/é")
    with pytest.raises(ValueError, match="must be ASCII"):
        DynamoDriver("http://bücher.example:9000")
