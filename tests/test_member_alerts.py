"""Members that need a person's look are raised by the leader (``member_alert``
events, the ``lorabus_member_alerts`` metric), and cleared once they recover:
an engine paused while no update is in flight, an engine not ready."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Callable

from events import EventListener

from lorabus.bus.connect import close, connect
from lorabus.coordinator.alerts import (
    NOT_READY_ALERT_AFTER_S,
    PAUSED_ALERT_AFTER_S,
    Condition,
    MemberAlerts,
)
from lorabus.coordinator.membership import Member
from lorabus.schemas import Heartbeat, MemberAlert, Subjects
from lorabus.testbed.stack import EmbeddedStack


def _member(worker_id: str, *, paused: bool = False, ready: bool = True, why: str = "") -> Member:
    beat = Heartbeat(
        worker_id=worker_id, world_size=1, engine="dynamo", adapters=[], paused=paused,
        interval_s=1.0, ready=ready, unready_reason=why,
    )  # fmt: skip
    return Member(heartbeat=beat, seen_at=0.0, joined_at=0.0)


async def _alerts(listener: EventListener, count: int) -> list[MemberAlert]:
    """The first ``count`` member alerts heard (a reload fails three times
    before its member is raised: longer than the listener's own deadline)."""
    async with asyncio.timeout(60):
        while len(found := [e for e in listener.events if isinstance(e, MemberAlert)]) < count:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
    return found


def _raised(alerts: MemberAlerts) -> set[tuple[str, Condition]]:
    return set(alerts.active)


def test_a_paused_engine_is_raised_only_outside_updates_and_after_a_while() -> None:
    alerts = MemberAlerts()
    fleet = {"w000": _member("w000", paused=True), "w001": _member("w001")}

    during_update = alerts.evaluate(fleet, update_running=True, at=0.0)
    at_first = alerts.evaluate(fleet, update_running=False, at=10.0)
    too_soon = alerts.evaluate(fleet, update_running=False, at=10.0 + PAUSED_ALERT_AFTER_S / 2)
    raised = alerts.evaluate(fleet, update_running=False, at=10.0 + PAUSED_ALERT_AFTER_S)
    again = alerts.evaluate(fleet, update_running=False, at=20.0)
    resumed = alerts.evaluate({"w000": _member("w000")}, update_running=False, at=21.0)

    assert during_update == at_first == too_soon == again == []
    assert [(c.worker_id, c.condition, c.cleared) for c in raised] == [
        ("w000", Condition.PAUSED_OUTSIDE_UPDATE, False)
    ]
    assert [(c.worker_id, c.condition, c.cleared) for c in resumed] == [
        ("w000", Condition.PAUSED_OUTSIDE_UPDATE, True)
    ]
    assert alerts.counts() == {Condition.PAUSED_OUTSIDE_UPDATE: 0, Condition.NOT_READY: 0}


def test_a_stuck_member_is_raised_at_once_a_converging_one_only_after_a_while() -> None:
    alerts = MemberAlerts()
    fleet = {
        "w000": _member("w000", ready=False, why="loading policy-v1 failed 3 times"),
        "w001": _member("w001", ready=False),
    }

    at_once = alerts.evaluate(fleet, update_running=True, at=0.0)
    later = alerts.evaluate(fleet, update_running=True, at=NOT_READY_ALERT_AFTER_S)
    gone = alerts.evaluate({}, update_running=False, at=NOT_READY_ALERT_AFTER_S + 1)

    assert [(c.worker_id, c.reason) for c in at_once] == [
        ("w000", "loading policy-v1 failed 3 times")
    ]
    assert [(c.worker_id, c.condition) for c in later] == [("w001", Condition.NOT_READY)]
    assert {(c.worker_id, c.cleared) for c in gone} == {("w000", True), ("w001", True)}
    assert _raised(alerts) == set()


def test_forget_drops_what_was_raised() -> None:
    alerts = MemberAlerts()
    alerts.evaluate({"w0": _member("w0", ready=False, why="x")}, update_running=False, at=0.0)
    assert alerts.counts()[Condition.NOT_READY] == 1

    alerts.forget()

    assert alerts.counts()[Condition.NOT_READY] == 0


async def test_an_engine_left_paused_by_an_update_is_raised_then_cleared(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    """w001's engine takes 3 s to resume while the resume phase waits 2 s: the
    update ends with it paused, the leader raises it, and clears it once the
    agent's pause lease has resumed it."""
    nc = await connect(nats_url, name="test-listener")
    listener = EventListener(nc, Subjects(fleet=fleet_name))
    await listener.start()
    try:
        async with make_stack([1, 1], phase_timeout_s=2.0, pause_lease_s=6.0) as stack:
            assert stack.client is not None and stack.sim is not None
            assert stack.coordinator is not None
            stack.sim.workers["w001"].set_faults(latency_s={"resume": 3.0})
            await stack.client.update("policy", make_adapter(1), version=1, timeout_s=60)
            raised = (await _alerts(listener, 1))[0]
            metric = stack.coordinator.metrics.registry.get_sample_value(
                "lorabus_member_alerts", {"condition": "paused_outside_update"}
            )
            cleared = (await _alerts(listener, 2))[1]
            metric_after = stack.coordinator.metrics.registry.get_sample_value(
                "lorabus_member_alerts", {"condition": "paused_outside_update"}
            )
    finally:
        await close(nc)

    assert (raised.worker_id, raised.condition, raised.cleared) == (
        "w001",
        "paused_outside_update",
        False,
    )
    assert raised.source == "coordinator" and raised.epoch == 1
    assert metric == 1
    assert (cleared.worker_id, cleared.condition, cleared.cleared) == (
        "w001",
        "paused_outside_update",
        True,
    )
    assert metric_after == 0


async def test_a_member_that_cannot_converge_is_raised(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    nc = await connect(nats_url, name="test-listener")
    listener = EventListener(nc, Subjects(fleet=fleet_name))
    await listener.start()
    try:
        async with make_stack([1, 1]) as stack:
            assert stack.client is not None and stack.sim is not None
            assert stack.coordinator is not None
            committed_dir = make_adapter(1)
            assert (await stack.client.update("policy", committed_dir, version=1)).committed
            shutil.rmtree(committed_dir)
            stack.sim.workers["w001"].remove_adapter("policy-v1")  # as an engine restart would
            alert = (await _alerts(listener, 1))[0]
            metric = stack.coordinator.metrics.registry.get_sample_value(
                "lorabus_member_alerts", {"condition": "not_ready"}
            )
    finally:
        await close(nc)

    assert (alert.worker_id, alert.condition, alert.cleared) == ("w001", "not_ready", False)
    # At least three failures in a row; more may pile up before the alert is read.
    failures = re.search(r"failed (\d+) times", alert.reason)
    assert "policy-v1" in alert.reason and failures and int(failures[1]) >= 3, alert.reason
    assert metric == 1
