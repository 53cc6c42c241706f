"""Coordinator and agent metrics, scraped in Prometheus text format over HTTP."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from lorabus.agents import DynamoDriver
from lorabus.agents.engine import InPlaceReplace
from lorabus.agents.metrics import AgentMetrics, instrumented
from lorabus.agents.vllm import VllmDriver
from lorabus.cli.metrics_http import serving
from lorabus.coordinator.alerts import MemberAlerts
from lorabus.coordinator.membership import Membership
from lorabus.coordinator.metrics import ADAPTER_LABELS, OTHER_ADAPTERS, CoordinatorMetrics
from lorabus.errors import EngineError
from lorabus.simfleet import SimFleet
from lorabus.testbed.natsserver import free_port
from lorabus.testbed.stack import EmbeddedStack


async def _scrape(port: int) -> str:
    async with httpx.AsyncClient(timeout=5) as http:
        response = await http.get(f"http://127.0.0.1:{port}/metrics")
    response.raise_for_status()
    return response.text


async def test_the_coordinator_exports_updates_phases_acks_and_membership(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([2, 1]) as stack:
        assert stack.client is not None and stack.coordinator is not None
        assert (await stack.client.update("policy", make_adapter(1), version=1)).committed
        port = free_port()
        with serving(stack.coordinator.metrics.registry, port, host="127.0.0.1"):
            text = await _scrape(port)

    assert 'lorabus_updates_total{adapter="policy",outcome="committed"} 1.0' in text
    assert 'lorabus_update_duration_seconds_count{adapter="policy"} 1.0' in text
    assert "lorabus_updates_running 0.0" in text
    for phase in ("pause", "load", "verify", "resume"):
        assert f'lorabus_phase_duration_seconds_count{{phase="{phase}"}} 1.0' in text
    assert 'lorabus_acks_total{outcome="ok",phase="load"} 2.0' in text
    assert "lorabus_pause_window_seconds_count 1.0" in text
    assert "lorabus_engines_paused 0.0" in text
    assert 'lorabus_heartbeat_age_seconds{worker="w000"}' in text
    # One series for leadership, whatever the number of terms.
    assert "lorabus_coordinator_leading 1.0" in text
    assert "lorabus_coordinator_epoch 1.0" in text
    assert "epoch=" not in text


async def test_an_agent_exports_engine_call_latency_and_errors_by_operation(
    make_adapter: Callable[[int], str],
) -> None:
    metrics = AgentMetrics()
    async with SimFleet(["w1"], [1]) as sim:
        driver = instrumented(DynamoDriver(sim.system_url("w1")), metrics, "w1")
        try:
            await driver.pause()
            await driver.load_adapter("p-v1", make_adapter(1), budget_s=5)
            sim.workers["w1"].set_faults(fail_next_loads=100)
            with pytest.raises(EngineError):
                await driver.load_adapter("p-v2", make_adapter(2), budget_s=0.01)
        finally:
            await driver.aclose()
    port = free_port()
    with serving(metrics.registry, port, host="127.0.0.1"):
        text = await _scrape(port)

    assert 'lorabus_engine_call_seconds_count{operation="pause",worker="w1"} 1.0' in text
    assert 'lorabus_engine_call_seconds_count{operation="load",worker="w1"} 2.0' in text
    assert 'lorabus_engine_call_errors_total{operation="load",worker="w1"} 1.0' in text


async def test_the_timed_driver_replaces_in_place_only_where_its_driver_does(
    make_adapter: Callable[[int], str],
) -> None:
    """The agent replaces a fixed name in place when its driver can (vLLM); the
    metrics wrapper around the driver must not hide that, nor claim it for
    Dynamo, which cannot."""
    metrics = AgentMetrics()
    second = make_adapter(2)
    async with SimFleet(["w1", "w2"], [1, 1], engines=["vllm", "dynamo"]) as sim:
        vllm = instrumented(VllmDriver(sim.system_url("w1")), metrics, "w1")
        dynamo = instrumented(DynamoDriver(sim.system_url("w2")), metrics, "w2")
        try:
            assert isinstance(vllm, InPlaceReplace) and not isinstance(dynamo, InPlaceReplace)
            await vllm.load_adapter("p", make_adapter(1), budget_s=5)
            await vllm.replace_adapter("p", second, budget_s=5)
        finally:
            await vllm.aclose()
            await dynamo.aclose()
        assert sim.workers["w1"].adapter_paths == {"p": second}
    port = free_port()
    with serving(metrics.registry, port, host="127.0.0.1"):
        text = await _scrape(port)

    assert 'lorabus_engine_call_seconds_count{operation="replace",worker="w1"} 1.0' in text


def test_adapters_past_the_bound_share_one_label() -> None:
    """Adapter names come from requests: the series per adapter are bounded."""
    metrics = CoordinatorMetrics(Membership(), MemberAlerts())
    labels = [metrics.adapter_label(f"a{i}") for i in range(ADAPTER_LABELS + 10)]

    assert labels[:ADAPTER_LABELS] == [f"a{i}" for i in range(ADAPTER_LABELS)]
    assert set(labels[ADAPTER_LABELS:]) == {OTHER_ADAPTERS}
    assert metrics.adapter_label("a0") == "a0", "one seen before keeps its own"
