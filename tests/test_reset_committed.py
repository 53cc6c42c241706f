"""An operator resets an adapter's committed state: the way out after a bogus
version was committed, recorded in the trail, and safe for the engines.

Against a real nats-server, the simulated HTTP engines and a real agent per
worker: a version near the int64 bound is committed, every later version is
``stale_version``; after ``lorabus reset`` a low version commits under a new
lineage of served names, the engines retire the bogus one, and nothing of an
earlier lineage can be mistaken for a later one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import pytest
from events import EventListener
from processes import run_lorabus

from lorabus.bus.connect import close, connect
from lorabus.coordinator.adapter_store import AdapterStore
from lorabus.coordinator.bus import CoordinatorBus
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.reports import Reports
from lorabus.coordinator.resets import lineage as lineage_of
from lorabus.coordinator.service import Coordinator
from lorabus.coordinator.store import FleetStore
from lorabus.coordinator.term import Term
from lorabus.operator import reset_committed
from lorabus.schemas import (
    INT64_MAX,
    BadMessage,
    CommittedReset,
    ErrorCode,
    Subjects,
)
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 15.0
BOGUS = INT64_MAX - 1


@pytest.fixture
async def stack(make_stack: Callable[..., EmbeddedStack]) -> AsyncIterator[EmbeddedStack]:
    async with make_stack([1, 2], keep=1) as started:
        yield started


async def test_a_reset_lets_a_lower_version_commit_under_a_new_lineage(
    stack: EmbeddedStack, nats_url: str, fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None and stack.sim is not None
    subjects = Subjects(fleet=fleet_name)
    bogus_path, step_3 = make_adapter(1), make_adapter(3)
    bogus = await stack.client.update("policy", bogus_path, version=BOGUS)
    assert bogus.committed, bogus.error
    stale = await stack.client.update("policy", step_3, version=3)
    assert stale.error is not None and stale.error.code == ErrorCode.STALE_VERSION

    nc = await connect(nats_url, name="test-operator")
    listener = EventListener(nc, subjects)
    await listener.start()
    try:
        reset = await reset_committed(nc, subjects, "policy", "step counter overflowed")
        [event] = await listener.wait_for(CommittedReset)
    finally:
        await close(nc)
    after = await stack.client.update("policy", step_3, version=3)
    engines_hold = await _engines_once_retired(stack, "policy-v")
    status = await stack.client.status()

    assert reset.ok and reset.lineage == 1, reset
    assert (reset.previous_version, reset.previous_path) == (BOGUS, bogus_path)
    assert (event.adapter, event.lineage, event.previous_version) == ("policy", 1, BOGUS)
    assert event.previous_served_name == f"policy-v{BOGUS}"
    assert event.reason == "step counter overflowed"
    assert after.committed, after.error
    assert after.adapter == "policy-r1-v3"
    assert (status.committed_adapter, status.committed_version) == ("policy-r1-v3", 3)
    assert all(m.ready for m in status.members), status
    assert engines_hold == {"w000": ["policy-r1-v3"], "w001": ["policy-r1-v3"]}


async def test_a_reset_with_a_wrong_expected_version_or_nothing_committed_changes_nothing(
    stack: EmbeddedStack, nats_url: str, fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None
    subjects = Subjects(fleet=fleet_name)
    nc = await connect(nats_url, name="test-operator")
    try:
        nothing = await reset_committed(nc, subjects, "policy", "nothing there")
        first = await stack.client.update("policy", make_adapter(5), version=5)
        guarded = await reset_committed(
            nc, subjects, "policy", "someone else's bad step", expected_version=4
        )
        lower = await stack.client.update("policy", make_adapter(2), version=2)
    finally:
        await close(nc)

    assert not nothing.ok and nothing.error is not None
    assert nothing.error.code == ErrorCode.BAD_REQUEST and "nothing is committed" in (
        nothing.error.message
    )
    assert first.committed, first.error
    assert not guarded.ok and guarded.error is not None
    assert guarded.error.code == ErrorCode.BAD_REQUEST and "not 4" in guarded.error.message
    assert lower.error is not None and lower.error.code == ErrorCode.STALE_VERSION


async def test_a_malformed_reset_request_is_answered_and_reported(
    stack: EmbeddedStack, nats_url: str, fleet_name: str
) -> None:
    subjects = Subjects(fleet=fleet_name)
    nc = await connect(nats_url, name="test-attacker")
    listener = EventListener(nc, subjects)
    await listener.start()
    try:
        bodies = [
            b"not json",
            b'{"type": "reset_request", "adapter": "policy"}',  # no reason
            b'{"type": "reset_request", "adapter": "policy", "reason": "x",'
            b' "expected_version": 99999999999999999999}',
            b"[" * 5000,
        ]
        replies = [
            json.loads((await nc.request(subjects.reset_request(), body, timeout=10)).data)
            for body in bodies
        ]
        reported = await listener.wait_for(BadMessage, len(bodies))
    finally:
        await close(nc)

    assert all(r["ok"] is False and r["error"]["code"] == "bad_request" for r in replies), replies
    assert all(e.subject == subjects.reset_request() for e in reported)


async def test_the_lineage_outlives_the_term_that_reset_it(
    stack: EmbeddedStack, nats_url: str, fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    """A successor, with nothing of the reset in memory, reads the lineage from KV."""
    assert stack.client is not None
    subjects = Subjects(fleet=fleet_name)
    assert (await stack.client.update("policy", make_adapter(9), version=9)).committed
    nc = await connect(nats_url, name="test-successor")
    try:
        assert (await reset_committed(nc, subjects, "policy", "first")).ok
        assert (await stack.client.update("policy", make_adapter(1), version=1)).committed
        assert (await reset_committed(nc, subjects, "policy", "second")).lineage == 2
        config = CoordinatorConfig(
            fleet=fleet_name, frontend_url="http://127.0.0.1:9", expected_world_size=3
        )
        store = await FleetStore.open(nc, config)
        successor = Coordinator(config)
        bus = CoordinatorBus(nc, subjects, successor.membership)
        term = Term(
            epoch=2,
            holder=successor.holder,
            config=config,
            store=store,
            bus=bus,
            membership=successor.membership,
            metrics=successor.metrics,
            reports=Reports(bus, subjects, lambda: 2),
            leading=successor.leading,
            max_payload=lambda: nc.max_payload,
            adapters=AdapterStore(nc, subjects),
        )
        lineage = await lineage_of(term, "policy", None)
        committed = await store.read_committed("policy")
    finally:
        await close(nc)

    assert lineage == 2
    assert committed is None


async def test_lorabus_reset_on_the_command_line(
    stack: EmbeddedStack, nats_url: str, fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None
    assert (await stack.client.update("policy", make_adapter(7), version=7)).committed
    args = ["reset", "--nats", nats_url, "--fleet", fleet_name, "--adapter", "policy"]

    refused = await run_lorabus(*args, "--reason", "guarded", "--expected-version", "6")
    done = await run_lorabus(*args, "--reason", "ticket 42", "--json")
    again = await run_lorabus(*args, "--reason", "twice")

    assert refused.returncode == 1 and "not 6" in refused.stderr, refused
    assert done.returncode == 0, done
    assert json.loads(done.stdout)["previous_version"] == 7
    assert again.returncode == 1 and "nothing is committed" in again.stderr, again


async def _engines_once_retired(stack: EmbeddedStack, prefix: str) -> dict[str, list[str]]:
    """Each engine's adapters, once none starts with ``prefix`` (retiring runs
    after the update is answered); what they hold at the deadline otherwise."""
    assert stack.sim is not None
    async with asyncio.timeout(DEADLINE_S):
        while _holding(stack, prefix):  # noqa: ASYNC110 (the sim has no event for it)
            await asyncio.sleep(0.05)
    return {wid: sorted(w.adapters) for wid, w in stack.sim.workers.items()}


def _holding(stack: EmbeddedStack, prefix: str) -> bool:
    assert stack.sim is not None
    return any(name.startswith(prefix) for w in stack.sim.workers.values() for name in w.adapters)
