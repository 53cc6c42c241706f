"""Every kind of poison on every subject family of a live fleet harms no process.

For each subject family (``cmd``, ``cmd.<w>``, ``ack.<w>``, ``hb.<w>``,
``req.update``, ``req.status``, ``evt.agent.<w>.<kind>``,
``evt.coordinator.<kind>``) a saboteur sends each kind of poison: not JSON,
100000 open brackets, a valid message with a deeply nested unknown field, an
int of 2^70, an unknown type tag, the largest payload the server takes, ids
with a space, a dot or a final newline, and ``1e400`` written literally.
Then every agent and the coordinator still run and beat, the coordinator
answers status, and an update commits. Who decodes the family reports what
it dropped as ``bad_message`` (at most ten a second each, so at least one);
a poisoned update request is answered ``bad_request``, a poisoned status
request with the fleet's status (the coordinator does not read its body).

Everything runs against a real nats-server and the embedded stack. The
checks of one family are gathered and asserted together at the end, so one
finding does not hide the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from poison import as_tree, poison_payloads

from lorabus.bus.connect import close, connect
from lorabus.schemas import (
    Ack,
    BadMessage,
    BadPayload,
    CommandHandled,
    ErrorCode,
    Heartbeat,
    PauseCommand,
    Phase,
    StatusRequest,
    Subjects,
    UpdateFinished,
    UpdateRequest,
    event_decoder,
    fleet_status_decoder,
    heartbeat_decoder,
    update_result_decoder,
)
from lorabus.testbed.stack import EmbeddedStack

WORKERS = ("w000", "w001")
VICTIM = "w001"
"""The worker named by the per-worker subjects."""
BAD_WORKER_IDS = {"a space": "w 001", "a dot": "w.001", "a final newline": "w001\n"}
BAD_UPDATE_IDS = {"a space": "poison 1", "a final newline": "poison-1\n"}
"""Dots are allowed in update ids; a final newline is not (docs/protocol.md)."""
WAIT_S = 10.0


@dataclass(frozen=True)
class Family:
    """One subject family and what its poison is made from."""

    subject: Callable[[Subjects], str]
    base: Callable[[str], Any]
    """The valid message the poison is made from, given an adapter's path."""
    id_field: str
    bad_ids: dict[str, str]
    int_field: str
    float_field: str
    reporters: frozenset[str] = frozenset()
    """The sources that decode this family and must report what they drop."""
    request: bool = False


_COMMAND = {"update_id": "poison-1", "budget_s": 30.0, "epoch": 1}
_EVENT = {"ts": 1_700_000_000.5, "update_id": "poison-1", "epoch": 1}

FAMILIES = {
    "cmd": Family(
        subject=Subjects.cmd,
        base=lambda _: PauseCommand(**_COMMAND, targets=list(WORKERS)),
        id_field="targets",
        bad_ids=BAD_WORKER_IDS,
        int_field="epoch",
        float_field="budget_s",
        reporters=frozenset(f"agent:{w}" for w in WORKERS),
    ),
    "cmd.<w>": Family(
        subject=lambda s: s.cmd_worker(VICTIM),
        base=lambda _: PauseCommand(**_COMMAND, targets=[VICTIM]),
        id_field="targets",
        bad_ids=BAD_WORKER_IDS,
        int_field="epoch",
        float_field="budget_s",
        reporters=frozenset({f"agent:{VICTIM}"}),
    ),
    "ack.<w>": Family(
        subject=lambda s: s.ack(VICTIM),
        base=lambda _: Ack(
            update_id="poison-1",
            phase=Phase.LOAD,
            worker_id=VICTIM,
            ok=True,
            world_size=1,
            adapters=[],
            paused=False,
            epoch=1,
        ),
        id_field="worker_id",
        bad_ids=BAD_WORKER_IDS,
        int_field="world_size",
        float_field="duration_s",
        reporters=frozenset({"coordinator"}),
    ),
    "hb.<w>": Family(
        subject=lambda s: s.heartbeat(VICTIM),
        base=lambda _: Heartbeat(
            worker_id=VICTIM,
            world_size=1,
            engine="dynamo",
            adapters=[],
            paused=False,
            interval_s=0.2,
        ),
        id_field="worker_id",
        bad_ids=BAD_WORKER_IDS,
        int_field="epoch_seen",
        float_field="interval_s",
        reporters=frozenset({"coordinator"}),
    ),
    "req.update": Family(
        subject=Subjects.update_request,
        # A real adapter: were the id ignored, this would be a valid update.
        base=lambda path: UpdateRequest(
            update_id="poison-1", adapter="poisoned", path=path, version=9
        ),
        id_field="update_id",
        bad_ids=BAD_UPDATE_IDS,
        int_field="version",
        float_field="version",
        reporters=frozenset({"coordinator"}),
        request=True,
    ),
    "req.status": Family(
        subject=Subjects.status_request,
        base=lambda _: StatusRequest(),
        id_field="worker_id",
        bad_ids=BAD_WORKER_IDS,
        int_field="v",
        float_field="v",
        request=True,
    ),
    "evt.agent.<w>.<kind>": Family(
        subject=lambda s: s.agent_event(VICTIM, "command_handled"),
        base=lambda _: CommandHandled(
            **_EVENT, source=f"agent:{VICTIM}", phase=Phase.LOAD, worker_id=VICTIM, ok=True
        ),
        id_field="worker_id",
        bad_ids=BAD_WORKER_IDS,
        int_field="epoch",
        float_field="ts",
    ),
    "evt.coordinator.<kind>": Family(
        subject=lambda s: s.coordinator_event("update_finished"),
        base=lambda _: UpdateFinished(**_EVENT, source="coordinator", status="committed"),
        id_field="update_id",
        bad_ids=BAD_UPDATE_IDS,
        int_field="epoch",
        float_field="ts",
    ),
}


@dataclass
class Reports:
    """The ``bad_message`` events the fleet emits, as they come."""

    seen: list[BadMessage] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def on_event(self, msg: Msg) -> None:
        try:
            event = event_decoder.decode(msg.data)
        except BadPayload:  # the saboteur's own poison on the event subjects
            return
        if isinstance(event, BadMessage) and msg.subject.endswith(".bad_message"):
            self.seen.append(event)
            self.changed.set()

    def sources_about(self, subject: str) -> set[str]:
        return {report.source for report in self.seen if report.subject == subject}

    async def wait_sources(self, subject: str, sources: frozenset[str]) -> set[str]:
        """Wait until each of ``sources`` reported a message on ``subject``;
        return those that did not within the wait."""
        deadline = time.monotonic() + WAIT_S
        while not sources <= self.sources_about(subject):
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), deadline - time.monotonic())
            if time.monotonic() >= deadline:
                break
        return set(sources - self.sources_about(subject))


@pytest.fixture
async def saboteur(nats_url: str) -> AsyncIterator[NatsClient]:
    nc = await connect(nats_url, name="test-poisoner")
    try:
        yield nc
    finally:
        await close(nc)


@pytest.mark.parametrize("name", FAMILIES)
async def test_poison_on_each_subject_family_is_dropped_and_harms_no_process(
    name: str,
    saboteur: NatsClient,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    family = FAMILIES[name]
    subjects = Subjects(fleet=fleet_name)
    subject = family.subject(subjects)
    problems: list[str] = []
    async with make_stack([2, 1]) as stack:
        assert stack.client is not None and stack.coordinator is not None
        reports = Reports()
        await saboteur.subscribe(subjects.event_any(), cb=reports.on_event)
        await saboteur.flush()
        pauses_before = _pauses(stack)
        payloads = poison_payloads(
            as_tree(family.base(make_adapter(9))),
            id_field=family.id_field,
            bad_ids=family.bad_ids,
            int_field=family.int_field,
            float_field=family.float_field,
            largest=saboteur.max_payload,
        )

        for what, payload in payloads.items():
            if not family.request:
                await saboteur.publish(subject, payload)
                continue
            try:
                reply = await saboteur.request(subject, payload, timeout=WAIT_S)
            except nats.errors.TimeoutError:
                problems.append(f"{what}: no reply within {WAIT_S:g}s")
                continue
            check = _check_update_reply if name == "req.update" else _check_status_reply
            problem = check(reply.data, stack)
            if problem is not None:
                problems.append(f"{what}: {problem}")
        await saboteur.flush()

        silent = await reports.wait_sources(subject, family.reporters)
        problems += [f"{source} reported no bad_message about {subject}" for source in silent]
        problems += [f"{task} died" for task in _dead_services(stack)]
        problems += await _missing_heartbeats(saboteur, subjects)
        if _pauses(stack) != pauses_before:
            problems.append(f"poison paused engines: {_pauses(stack) - pauses_before} pause(s)")
        status = await stack.client.status(timeout_s=WAIT_S)
        if sorted(m.worker_id for m in status.members) != list(WORKERS):
            problems.append(f"status after the poison lists {status.members}")
        if status.leader != stack.coordinator.holder:
            problems.append(f"status after the poison names leader {status.leader!r}")
        result = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
        if not result.committed:
            problems.append(f"the update after the poison did not commit: {result.error}")

    assert not problems, f"poison on {subject}:\n" + "\n".join(problems)


def _check_update_reply(data: bytes, stack: EmbeddedStack) -> str | None:
    """A poisoned update request must be answered bad_request, as malformed."""
    try:
        answer = update_result_decoder.decode(data)
    except BadPayload as exc:
        return f"the reply does not decode: {exc}"
    error = answer.error
    if (
        answer.status != "failed"
        or error is None
        or error.code != ErrorCode.BAD_REQUEST
        or not error.message.startswith("malformed update request: ")
    ):
        return (
            f"answered {answer.status} (update id {answer.update_id!r}, adapter "
            f"{answer.adapter!r}, error {error}), not bad_request as malformed"
        )
    return None


def _check_status_reply(data: bytes, stack: EmbeddedStack) -> str | None:
    """A status request's body is not read: poison or not, the answer is the status."""
    try:
        status = fleet_status_decoder.decode(data)
    except BadPayload as exc:
        return f"the reply is not a fleet status: {exc} ({data[:200]!r})"
    if sorted(m.worker_id for m in status.members) != list(WORKERS):
        return f"the status lists members {[m.worker_id for m in status.members]}"
    return None


def _dead_services(stack: EmbeddedStack) -> list[str]:
    """The stack's services (coordinator, agent-w000, ...) whose task has ended;
    the stack keeps them in ``_tasks``, and has no public handle on them."""
    tasks: list[asyncio.Task[None]] = stack._tasks
    assert len(tasks) == 1 + len(WORKERS), [task.get_name() for task in tasks]
    return [
        f"{task.get_name()} ({task.exception()!r})" if not task.cancelled() else task.get_name()
        for task in tasks
        if task.done()
    ]


async def _missing_heartbeats(nc: NatsClient, subjects: Subjects) -> list[str]:
    """Wait for a heartbeat of every agent sent after the poison; name those
    that sent none within the wait."""
    heard: set[str] = set()
    everyone = asyncio.Event()

    async def on_heartbeat(msg: Msg) -> None:
        try:
            beat = heartbeat_decoder.decode(msg.data)
        except BadPayload:
            return
        if msg.subject == subjects.heartbeat(beat.worker_id) and beat.instance:
            heard.add(beat.worker_id)
            if heard >= set(WORKERS):
                everyone.set()

    sub = await nc.subscribe(subjects.heartbeat_any(), cb=on_heartbeat)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(everyone.wait(), WAIT_S)
    finally:
        await sub.unsubscribe()
    return [f"agent {w} sent no heartbeat after the poison" for w in WORKERS if w not in heard]


def _pauses(stack: EmbeddedStack) -> int:
    assert stack.sim is not None
    return sum(
        w.count_requests("POST", "/engine/pause_generation") for w in stack.sim.workers.values()
    )
