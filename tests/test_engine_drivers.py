"""Every engine driver keeps the same contract, each over its own engine's documented routes.

The Dynamo, vLLM and SGLang drivers are built the way an agent builds them
(``driver_for`` from an ``AgentConfig``) and run against the simulated
fleet's personality of that engine over real HTTP. Dynamo-only behaviour (URL
segments, the status-200 error quirk, a refused keep-mode pause) is in
``test_dynamo_driver.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from lorabus.agents import AgentConfig, EngineDriver, driver_for
from lorabus.errors import EngineError
from lorabus.simfleet import ENGINES, SimFleet, SimWorker

KINDS = pytest.mark.parametrize("kind", ENGINES)


@pytest.fixture
async def sim(kind: str) -> AsyncIterator[SimFleet]:
    async with SimFleet(["w1"], [2], api_key="k", engines=[kind]) as fleet:
        yield fleet


def _driver(sim: SimFleet, kind: str, *, key: str | None = "k") -> EngineDriver:
    config = AgentConfig(
        fleet="f",
        worker_id="w1",
        system_url=sim.system_url("w1"),
        engine=kind,
        engine_timeout_s=5,
        headers={"Authorization": f"Bearer {key}"} if key else {},
    )
    return driver_for(config)


@pytest.fixture
async def driver(sim: SimFleet, kind: str) -> AsyncIterator[EngineDriver]:
    engine = _driver(sim, kind)
    yield engine
    await engine.aclose()


def _worker(sim: SimFleet) -> SimWorker:
    return sim.workers["w1"]


def _calls(sim: SimFleet) -> list[tuple[str, str, object]]:
    return [(r.method, r.raw_path, r.body) for r in _worker(sim).requests]


def _expected_calls(kind: str, name: str, path: str) -> list[tuple[str, str, object]]:
    """The documented requests of pause, load, list, unload, resume (ENGINES.md)."""
    if kind == "dynamo":
        return [
            ("POST", "/engine/pause_generation", {"mode": "keep", "clear_cache": False}),
            ("POST", "/v1/loras", {"lora_name": name, "source": {"uri": Path(path).as_uri()}}),
            ("GET", "/v1/loras", None),
            ("DELETE", "/v1/loras/org%2Fpolicy-v1", None),
            ("POST", "/engine/resume_generation", {}),
        ]
    if kind == "vllm":
        return [
            ("POST", "/pause?mode=keep", None),
            ("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}),
            ("GET", "/v1/models", None),
            ("POST", "/v1/unload_lora_adapter", {"lora_name": name}),
            ("POST", "/resume", None),
        ]
    return [
        ("POST", "/pause_generation", {"mode": "in_place"}),
        ("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path}),
        ("GET", "/v1/models", None),
        ("POST", "/unload_lora_adapter", {"lora_name": name}),
        ("POST", "/continue_generation", {}),
    ]


@KINDS
async def test_pause_load_list_unload_resume_use_the_engines_own_routes_and_bodies(
    kind: str, sim: SimFleet, driver: EngineDriver, make_adapter: Callable[[int], str]
) -> None:
    path = make_adapter(1)
    await driver.pause()
    paused = _worker(sim).paused
    await driver.load_adapter("org/policy-v1", path, budget_s=5)
    listed = await driver.list_adapters()
    await driver.unload_adapter("org/policy-v1")
    await driver.resume()

    assert driver.kind == kind
    assert paused and not _worker(sim).paused
    assert listed == ["org/policy-v1"]
    assert _worker(sim).adapters == {}
    assert _calls(sim) == _expected_calls(kind, "org/policy-v1", path)
    assert all(r.headers["authorization"] == "Bearer k" for r in _worker(sim).requests)


@KINDS
async def test_a_server_error_is_retried_until_the_load_succeeds(
    kind: str, sim: SimFleet, driver: EngineDriver, make_adapter: Callable[[int], str]
) -> None:
    _worker(sim).set_faults(fail_next_loads=3)

    await driver.load_adapter("p", make_adapter(1), budget_s=10)

    assert _worker(sim).loads_received == 4
    assert "p" in _worker(sim).adapters


@KINDS
async def test_a_directory_without_an_adapter_fails_at_once(
    kind: str, sim: SimFleet, driver: EngineDriver, tmp_path: Path
) -> None:
    empty = tmp_path / "step_7"
    empty.mkdir()

    with pytest.raises(EngineError, match="not retried") as raised:
        await driver.load_adapter("p", str(empty), budget_s=10)

    assert not raised.value.retryable
    assert _worker(sim).loads_received == 1
    assert _worker(sim).adapters == {}


@KINDS
async def test_a_refused_token_is_not_retried(kind: str, sim: SimFleet) -> None:
    unauthenticated = _driver(sim, kind, key=None)
    try:
        with pytest.raises(EngineError, match="401") as raised:
            await unauthenticated.load_adapter("p", "/nowhere", budget_s=10)
    finally:
        await unauthenticated.aclose()

    assert raised.value.status == 401 and not raised.value.retryable
    assert len(_worker(sim).requests) == 1


@KINDS
async def test_a_client_error_status_is_not_retried(
    kind: str, sim: SimFleet, driver: EngineDriver, make_adapter: Callable[[int], str]
) -> None:
    _worker(sim).set_faults(fail_next_loads=1, load_failure_status=400)

    with pytest.raises(EngineError, match="answered 400") as raised:
        await driver.load_adapter("p", make_adapter(1), budget_s=10)

    assert not raised.value.retryable
    assert _worker(sim).loads_received == 1


@KINDS
async def test_an_unreachable_engine_is_a_retryable_engine_error(kind: str) -> None:
    config = AgentConfig(
        fleet="f", worker_id="w1", system_url="http://127.0.0.1:9", engine=kind, engine_timeout_s=1
    )
    engine = driver_for(config)
    try:
        with pytest.raises(EngineError, match="failed: ConnectError") as raised:
            await engine.pause()
    finally:
        await engine.aclose()
    assert raised.value.retryable


@KINDS
async def test_loading_a_name_again_from_the_same_path_is_done(
    kind: str, sim: SimFleet, driver: EngineDriver, make_adapter: Callable[[int], str]
) -> None:
    # A retry after a lost answer, or an agent restarted mid-update: vLLM and
    # SGLang refuse the second load, Dynamo answers "already loaded".
    path = make_adapter(1)
    await driver.load_adapter("p", path, budget_s=5)

    await driver.load_adapter("p", path, budget_s=5)

    assert await driver.list_adapters() == ["p"]
    assert _worker(sim).loads_received == 2


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_loading_a_name_again_from_another_path_is_a_final_error(
    kind: str, sim: SimFleet, driver: EngineDriver, make_adapter: Callable[[int], str]
) -> None:
    first, other = make_adapter(1), make_adapter(2)
    await driver.load_adapter("p", first, budget_s=5)

    with pytest.raises(EngineError, match="not") as raised:
        await driver.load_adapter("p", other, budget_s=5)

    assert not raised.value.retryable
    assert repr(first) in str(raised.value) and repr(other) in str(raised.value)
    assert _worker(sim).adapter_paths == {"p": first}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize("name", ["a/../../pause", "p?mode=abort", "p#frag", "..", "p%2F"])
async def test_names_travel_in_json_bodies_intact(
    kind: str, name: str, sim: SimFleet, driver: EngineDriver, make_adapter: Callable[[int], str]
) -> None:
    path = make_adapter(1)
    await driver.load_adapter(name, path, budget_s=5)
    listed = await driver.list_adapters()
    await driver.unload_adapter(name)

    assert listed == [name]
    assert [r.body for r in _worker(sim).requests if r.method == "POST"] == [
        {"lora_name": name, "lora_path": path},
        {"lora_name": name},
    ]
    assert not _worker(sim).paused and _worker(sim).adapters == {}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_unloading_a_name_the_engine_lacks_is_an_error(
    kind: str, sim: SimFleet, driver: EngineDriver
) -> None:
    with pytest.raises(EngineError, match="answered 40") as raised:
        await driver.unload_adapter("never-loaded")
    assert raised.value.status == (404 if kind == "vllm" else 400)


async def _raw_engine(answer: bytes | None) -> asyncio.Server:
    """An engine on a bare socket: it reads a request, then answers ``answer``
    (a whole HTTP response) or nothing at all."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            if answer is None:
                await reader.read()  # holds the connection until the client gives up
            else:
                writer.write(answer)
                await writer.drain()
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


def _raw_driver(server: asyncio.Server, kind: str) -> EngineDriver:
    port = server.sockets[0].getsockname()[1]
    config = AgentConfig(
        fleet="f",
        worker_id="w1",
        system_url=f"http://127.0.0.1:{port}",
        engine=kind,
        engine_timeout_s=0.5,
    )
    return driver_for(config)


@KINDS
async def test_an_engine_that_never_answers_is_a_retryable_timeout(kind: str) -> None:
    server = await _raw_engine(None)
    engine = _raw_driver(server, kind)
    try:
        async with asyncio.timeout(10):
            with pytest.raises(EngineError, match="failed: ReadTimeout") as raised:
                await engine.pause()
    finally:
        await engine.aclose()
        server.close()
        await server.wait_closed()
    assert raised.value.retryable


@KINDS
async def test_a_poisoned_answer_is_an_engine_error_not_a_crash(kind: str) -> None:
    nested = b"[" * 100_000 + b"]" * 100_000
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(nested), nested)
    )
    server = await _raw_engine(answer)
    engine = _raw_driver(server, kind)
    try:
        async with asyncio.timeout(10):
            with pytest.raises(EngineError, match=r"unexpected body|not status|without success"):
                await engine.list_adapters()
    finally:
        await engine.aclose()
        server.close()
        await server.wait_closed()
