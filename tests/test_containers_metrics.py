"""The ``containers`` tier, metrics as a platform team runs them: compose.yaml
with its ``metrics`` profile, run for real with podman. Prometheus (Debian's
package, in an image built on the same base as lorabus's) scrapes every
coordinator and agent; its HTTP API shows lorabus's series arriving, and the
alert for an engine held paused with no update in flight fires, then clears
once the engine resumes. One stack serves the module; the last test takes it
down and checks nothing of it is left. Skipped, with the reason, where
``scripts/setup-containers`` has not prepared podman and the base image.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from compose_stack import ComposeStack, runtime_missing, update_from_host
from nats_container import IMAGE

from lorabus._version import __version__
from lorabus.testbed.natsserver import free_port

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(600)]

FLEET = "default"
WORKERS = ("w000", "w001", "w002")
TARGETS = 5
"""compose.yaml's two coordinators and three agents."""
READY_DEADLINE_S = 150.0
ALERT_DEADLINE_S = 180.0
HELD_PAUSED = "LorabusEnginePausedWithoutUpdate"


@pytest.fixture(scope="module")
def stack() -> Iterator[ComposeStack]:
    reason = runtime_missing()
    if reason is not None:
        pytest.skip(reason)
    stack = ComposeStack(IMAGE, profiles=("metrics",))
    stack.env["LORABUS_PROMETHEUS_PORT"] = str(free_port())
    stack.build(__version__)
    try:
        stack.up()
        yield stack
    finally:
        try:
            stack.down()
        finally:
            stack.remove_leftovers()


def _prometheus(stack: ComposeStack) -> str:
    return f"http://127.0.0.1:{stack.env['LORABUS_PROMETHEUS_PORT']}"


def query(stack: ComposeStack, promql: str) -> list[dict[str, Any]]:
    """The instant vector ``promql`` (empty while Prometheus is not up yet)."""
    try:
        reply = httpx.get(
            f"{_prometheus(stack)}/api/v1/query", params={"query": promql}, timeout=10
        )
    except httpx.HTTPError:
        return []
    if reply.status_code != 200:
        return []
    return list(reply.json()["data"]["result"])


def alerts(stack: ComposeStack) -> dict[str, str]:
    """Each alert Prometheus holds now, by name: ``pending`` or ``firing``."""
    try:
        reply = httpx.get(f"{_prometheus(stack)}/api/v1/alerts", timeout=10)
    except httpx.HTTPError:
        return {}
    return {a["labels"]["alertname"]: a["state"] for a in reply.json()["data"]["alerts"]}


def until(what: str, check: Callable[[], bool], deadline_s: float, stack: ComposeStack) -> None:
    give_up = time.monotonic() + deadline_s
    while time.monotonic() < give_up:
        if check():
            return
        time.sleep(1)
    raise AssertionError(
        f"{what}: not within {deadline_s:.0f}s; alerts {alerts(stack)}\n"
        f"{stack.logs('prometheus')}\n{stack.all_logs()}"
    )


def _value(sample: dict[str, Any]) -> float:
    return float(sample["value"][1])


def set_faults(stack: ComposeStack, worker: str, **faults: object) -> None:
    reply = httpx.put(f"{stack.sim_url}/sim/workers/{worker}/faults", json=faults, timeout=10)
    reply.raise_for_status()


async def update(stack: ComposeStack, step: int) -> dict[str, Any]:
    return await update_from_host(
        stack, "--path", f"/adapters/step_{step}", fleet=FLEET, timeout_s=120
    )


async def test_prometheus_scrapes_every_coordinator_and_agent_and_sees_an_update(
    stack: ComposeStack,
) -> None:
    until(
        "every coordinator and agent scraped",
        lambda: sum(_value(s) for s in query(stack, 'up{job=~"lorabus-.*"}')) == TARGETS,
        READY_DEADLINE_S,
        stack,
    )
    until(
        "one coordinator leading, every worker beating",
        lambda: (
            sum(_value(s) for s in query(stack, "lorabus_coordinator_leading")) == 1
            and {
                s["metric"]["worker"]
                for s in query(stack, "max by (worker) (lorabus_heartbeat_age_seconds)")
            }
            == set(WORKERS)
        ),
        READY_DEADLINE_S,
        stack,
    )
    result = await update(stack, 1)
    assert result.get("status") == "committed", result
    until(
        "the committed update counted",
        lambda: (
            sum(_value(s) for s in query(stack, 'lorabus_updates_total{outcome="committed"}')) >= 1
        ),
        60,
        stack,
    )
    assert query(stack, "lorabus_engine_call_seconds_count"), "the agents' engine calls are scraped"
    assert HELD_PAUSED not in alerts(stack)


async def test_an_engine_held_paused_without_an_update_fires_the_alert_until_it_resumes(
    stack: ComposeStack,
) -> None:
    """w000's engine stops answering, so its pause's outcome is unknown: the
    update fails, its agent reports the engine as maybe paused, and the leader
    raises it as paused with no update in flight: the rule fires. Once the
    engine answers again, the agent resumes it and the alert clears."""
    set_faults(stack, "w000", hang=True)
    try:
        asking = asyncio.create_task(update(stack, 2))
        await asyncio.to_thread(
            until,
            f"{HELD_PAUSED} firing",
            lambda: alerts(stack).get(HELD_PAUSED) == "firing",
            ALERT_DEADLINE_S,
            stack,
        )
        result = await asking
    finally:
        set_faults(stack, "w000", hang=False)
    assert result.get("status") == "failed", result
    await asyncio.to_thread(
        until,
        "the engine resumed and the alert cleared",
        lambda: (
            HELD_PAUSED not in alerts(stack)
            and sum(_value(s) for s in query(stack, "lorabus_engines_paused")) == 0
        ),
        ALERT_DEADLINE_S,
        stack,
    )


def test_down_takes_prometheus_with_the_rest(stack: ComposeStack) -> None:
    assert "prometheus" in stack.containers()
    stack.down()
    assert stack.leftovers() == []
