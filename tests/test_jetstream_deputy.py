"""JetStream cannot be aimed: no role's JetStream call writes into the fleet.

JetStream answers every API call to the reply subject the caller chose, with
its own rights. With every role in the fleet's account, an agent's
stream-info request whose reply subject was the leader key overwrote the
leader record. In the accounts of ``lorabus auth init`` only the coordinators
share the fleet's account: for every JetStream call each other role may
make, an answer aimed at a KV key, a command, an ack, an event or a
JetStream API subject lands nowhere in the fleet: no KV record changes, no
other agent hears anything, the audit stream records nothing, the results
bucket is not purged, and the next update commits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from secured import watched

from lorabus.audit.tap import Tap
from lorabus.audit.verify import TrailRecord
from lorabus.bus.connect import close
from lorabus.schemas import Subjects
from lorabus.security.roles import FLEET_JS_API, Role, permissions
from lorabus.testbed.stack import EmbeddedStack

WORKERS = ("w000", "w001")


@pytest.fixture
def stack(secured_stack: EmbeddedStack) -> EmbeddedStack:
    return secured_stack


def _aims(s: Subjects) -> list[str]:
    """Reply subjects an attacker would aim JetStream's answer at."""
    return [
        f"$KV.{s.state_bucket()}.leader",
        f"$KV.{s.results_bucket()}.forged",
        s.cmd(),
        s.cmd_worker("w001"),
        s.ack("w001"),
        s.heartbeat("w001"),
        s.coordinator_event("update_finished"),
        s.agent_event("w001", "reconciled"),
        f"$JS.API.STREAM.PURGE.KV_{s.results_bucket()}",
        f"$JS.API.STREAM.PURGE.{s.audit_stream()}",
    ]


def _calls(role: Role, s: Subjects) -> list[tuple[str, bytes]]:
    """Every JetStream call ``role`` may make (as w000 for an agent), each with
    a body that JetStream answers."""
    granted = permissions(role, s, inbox_prefix="_INBOX", worker_id="w000")
    calls = []
    for subject in granted.publish:
        if not subject.startswith(FLEET_JS_API):
            continue
        subject = subject.replace(".>", f".$KV.{s.state_bucket()}.leader")
        body = json.dumps({"seq": 1}).encode() if ".DIRECT.GET." in subject else b""
        if ".MSG.GET." in subject:
            body = json.dumps({"last_by_subj": f"$KV.{s.state_bucket()}.leader"}).encode()
        calls.append((subject, body))
    return calls


async def _trail(stack: EmbeddedStack) -> list[TrailRecord]:
    records: list[TrailRecord] = []

    async def keep(record: TrailRecord) -> None:
        records.append(record)

    nc = await stack.bus_as(Role.AUDITOR).connect("test-auditor")
    try:
        await asyncio.wait_for(
            Tap(nc, Subjects(fleet=stack.fleet_name)).run(keep, follow=False), 30
        )
    finally:
        await close(nc)
    return records


OWN = "its own acks and events"
"""What an agent publishes into the fleet's account, where the audit stream
stores it: with a reply subject, JetStream would answer "stored" there."""


@pytest.mark.parametrize(
    ("role", "what"),
    [
        (Role.AGENT, "JetStream calls"),
        (Role.AUDITOR, "JetStream calls"),
        (Role.OPERATOR, "JetStream calls"),
        (Role.AGENT, OWN),
    ],
)
async def test_no_jetstream_answer_can_be_aimed_into_the_fleet(
    stack: EmbeddedStack, role: Role, what: str, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None
    s = Subjects(fleet=stack.fleet_name)
    first = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
    assert first.committed, first.error
    own = [s.ack("w000"), s.agent_event("w000", "reconciled")]
    calls = [(subject, b"{}") for subject in own] if what == OWN else _calls(role, s)
    assert calls, f"{role} makes no JetStream call: nothing was tried"

    coordinator = await stack.bus_as(Role.COORDINATOR).connect("test-observer")
    state = await coordinator.jetstream().key_value(s.state_bucket())
    results = await coordinator.jetstream().key_value(s.results_bucket())
    leader_before = await state.get("leader")
    results_before = (await coordinator.jetstream().stream_info(f"KV_{s.results_bucket()}")).state
    trail_before = await _trail(stack)
    heard: list[Msg] = []

    async def hear(msg: Msg) -> None:
        heard.append(msg)

    # The other agent hears its commands, the coordinator its acks.
    other = await stack.bus_as(Role.AGENT, "w001").connect("test-w001")
    try:
        for subject in (s.cmd(), s.cmd_worker("w001")):
            await other.subscribe(subject, cb=hear)
        await coordinator.subscribe(s.ack("w001"), cb=hear)
        await other.flush()
        await coordinator.flush()

        worker = "w000" if role is Role.AGENT else None
        async with watched(stack.bus_as(role, worker)) as attacker:
            for subject, body in calls:
                for aim in _aims(s):
                    await attacker.nc.publish(subject, body, reply=aim)
            if what == OWN:
                # Once the trail holds them all, any "stored" answer went out.
                await attacker.nc.flush()
                wanted = len(calls) * len(_aims(s)) + max(r.seq for r in trail_before)
                async with asyncio.timeout(30):
                    while max(r.seq for r in await _trail(stack)) < wanted:  # noqa: ASYNC110
                        await asyncio.sleep(0.1)
            else:
                # Proof that JetStream does answer these calls (a direct get of a
                # bucket that allows none has no responder, and so no deputy).
                answered = []
                for subject, body in calls:
                    with contextlib.suppress(nats.errors.NoRespondersError):
                        await attacker.nc.request(subject, body, timeout=10)
                        answered.append(subject)
                assert answered, "JetStream answered none of the calls: nothing was tried"
            assert attacker.refusals() == [], "the attack made only calls the role may make"

        assert heard == [], [m.subject for m in heard]
        # The leader renews its record meanwhile (a new revision of the same
        # bytes); a JetStream answer written over it, or the re-election that
        # would follow, would leave other bytes (a new epoch).
        leader_after = await state.get("leader")
        assert leader_after.value == leader_before.value
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await results.get("forged")
        results_after = (
            await coordinator.jetstream().stream_info(f"KV_{s.results_bucket()}")
        ).state
        assert results_after.messages >= results_before.messages, "the results bucket was purged"
    finally:
        await close(other)
        await close(coordinator)

    # Nothing reached the audit stream but what the attacker may publish itself.
    new = [r for r in await _trail(stack) if r.seq > max(r.seq for r in trail_before)]
    assert [r.subject for r in new if r.poison and r.subject not in own] == []
    second = await stack.client.update("policy", make_adapter(2), version=2, timeout_s=30)
    assert second.committed, second.error
