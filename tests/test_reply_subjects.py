"""A coordinator answers only into inboxes: a request whose reply subject is a
KV key, a command, an ack, an event or a JetStream API subject is refused and
not acted on, whoever sends it.

The attacks run against a real nats-server whose identities hold the
per-role permissions of ``lorabus/security/roles.py`` in one account, as a deployment
that creates its users by hand in an existing account does (``lorabus auth
init`` puts each role in an account of its own, where the server carries
every answer back into the requester's account and these replies cannot land
in the fleet; its stack is checked below to answer the ``_R_.`` subjects that
gives). The coordinator replies with its own rights (commands, both buckets,
its events) and the server lets it publish once to whatever reply subject a
request names, so the checks look where each answer would have landed, on a
privileged connection: the leader record and a stored result read back, an
agent's command subject, an ack subject and the event subject watched live,
the audit trail (commands, acks and events) read whole, the results
stream's size. Each refusal is counted and audited, and a real update commits
after. Agents and watchers connect as the account's unrestricted user.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import nkeys
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from secured import DEADLINE_S, watched

from lorabus.audit.tap import Tap
from lorabus.audit.verify import TrailRecord
from lorabus.bus.connect import Bus, close, connect
from lorabus.bus.options import BusOptions, inbox_prefix_for, public_key_of
from lorabus.coordinator.bus import reply_refusal
from lorabus.coordinator.config import StorageConfig
from lorabus.coordinator.store import FleetStore, result_key
from lorabus.coordinator.streams import provision
from lorabus.schemas import (
    ResetRequest,
    ResultRequest,
    StatusRequest,
    Subjects,
    UpdateRequest,
    encode,
)
from lorabus.security.roles import Role, permissions
from lorabus.testbed.natsserver import NatsServer
from lorabus.testbed.stack import EmbeddedStack

REPLY_KINDS = ("fleet_status", "update_result", "reset_result")
"""What an answer of the coordinator is (the ``type`` of its body)."""
RESTRICTED = (Role.COORDINATOR, Role.ORCHESTRATOR, Role.OPERATOR)


class OneAccountStack(EmbeddedStack):
    """The embedded stack on a server where the coordinator, the orchestrator
    and the operator connect with their roles' permissions, all in one account."""

    def __init__(self, identities: dict[Role, BusOptions], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.identities = identities

    def bus_as(self, role: Role, worker_id: str | None = None) -> Bus:
        return Bus(self.nats_url, self.identities.get(role, BusOptions()))


def _one_account_conf(folder: Path, subjects: Subjects) -> tuple[Path, dict[Role, BusOptions]]:
    users = ['{ user: "admin", password: "admin" }']
    identities = {}
    for role in RESTRICTED:
        seed = bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
        (folder / f"{role}.seed").write_bytes(seed)
        (folder / f"{role}.seed").chmod(0o600)
        key = public_key_of(seed)
        prefix = inbox_prefix_for(key)
        allowed = permissions(role, subjects, inbox_prefix=prefix)
        users.append(
            json.dumps(
                {
                    "nkey": key,
                    "permissions": {
                        "publish": {"allow": list(allowed.publish)},
                        "subscribe": {"allow": list(allowed.subscribe)},
                        **({"allow_responses": True} if allowed.allow_responses else {}),
                    },
                }
            )
        )
        identities[role] = BusOptions(
            nkey_seed_file=str(folder / f"{role}.seed"), inbox_prefix=prefix
        )
    conf = folder / "one-account.conf"
    joined = "\n".join(users)
    conf.write_text(
        f"accounts {{ FLEET {{ jetstream: enabled\n users: [\n{joined}\n] }} }}\n"
        'no_auth_user: "admin"\n'
    )
    return conf, identities


@pytest.fixture
async def stack(fleet_name: str, tmp_path: Path) -> AsyncIterator[EmbeddedStack]:
    subjects = Subjects(fleet=fleet_name)
    conf, identities = _one_account_conf(tmp_path, subjects)
    async with NatsServer(include=conf) as server:
        nc = await connect(server.url, name="test-provision")
        try:
            await provision(nc, StorageConfig(fleet=fleet_name))
        finally:
            await close(nc)
        one = OneAccountStack(
            identities, world_sizes=[1, 1], fleet=fleet_name, nats_url=server.url, heartbeat_s=0.2
        )
        async with one as started:
            yield started


def _targets(s: Subjects, committed_id: str) -> list[str]:
    """Where an attacker would have the coordinator's answer land."""
    return [
        f"$KV.{s.state_bucket()}.leader",
        f"$KV.{s.results_bucket()}.{result_key(committed_id)}",
        s.cmd_worker("w001"),
        s.ack("w000"),
        s.coordinator_event("x"),
        f"$JS.API.STREAM.PURGE.KV_{s.results_bucket()}",
    ]


def _request(kind: str, adapter_path: str, committed_id: str) -> tuple[str, bytes]:
    """A valid request of ``kind``: an update would pause the fleet, a reset
    would forget version 1, were they acted on."""
    if kind == "update":
        body = UpdateRequest(update_id="forged", adapter="policy", path=adapter_path, version=2)
        return "update", encode(body)
    if kind == "result":
        return "result", encode(ResultRequest(update_id=committed_id))
    if kind == "reset":
        return "reset", encode(ResetRequest(adapter="policy", reason="forged"))
    return "status", encode(StatusRequest())


def _refused(stack: EmbeddedStack, kind: str) -> float:
    assert stack.coordinator is not None
    registry = stack.coordinator.metrics.registry
    return registry.get_sample_value("lorabus_replies_refused_total", {"request": kind}) or 0.0


async def _trail(stack: EmbeddedStack) -> list[TrailRecord]:
    records: list[TrailRecord] = []

    async def keep(record: TrailRecord) -> None:
        records.append(record)

    nc = await stack.bus_as(Role.AUDITOR).connect("test-auditor")
    try:
        await Tap(nc, Subjects(fleet=stack.fleet_name)).run(keep, follow=False)
    finally:
        await close(nc)
    return records


def _answers(received: list[Msg]) -> list[str]:
    """The messages among ``received`` that are an answer of the coordinator."""
    kinds = []
    for msg in received:
        try:
            kind = msgspec.json.decode(msg.data).get("type")
        except (msgspec.DecodeError, AttributeError):
            kind = "undecodable"
        if kind in (*REPLY_KINDS, "undecodable"):
            kinds.append(f"{kind} on {msg.subject}")
    return kinds


async def _listen(nc: NatsClient, subject: str) -> list[Msg]:
    received: list[Msg] = []

    async def keep(msg: Msg) -> None:
        received.append(msg)

    await nc.subscribe(subject, cb=keep)
    await nc.flush()
    return received


@pytest.mark.parametrize(
    ("role", "kind"),
    [
        (Role.ORCHESTRATOR, "update"),
        (Role.ORCHESTRATOR, "status"),
        (Role.ORCHESTRATOR, "result"),
        (Role.OPERATOR, "status"),
        (Role.OPERATOR, "reset"),
    ],
)
async def test_a_reply_subject_that_is_no_inbox_is_refused_and_nothing_lands_there(
    stack: EmbeddedStack, role: Role, kind: str, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None and stack.sim is not None and stack.coordinator is not None
    s = Subjects(fleet=stack.fleet_name)
    first = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
    assert first.committed, first.error
    targets = _targets(s, first.update_id)
    subject_of = {
        "update": s.update_request(),
        "status": s.status_request(),
        "result": s.result_request(),
        "reset": s.reset_request(),
    }
    _, body = _request(kind, make_adapter(2), first.update_id)

    async with (
        watched(stack.bus_as(Role.AUDITOR)) as watcher,  # unrestricted
        watched(stack.bus_as(role)) as attacker,
    ):
        on_cmd = await _listen(watcher.nc, s.cmd_worker("w001"))
        on_ack = await _listen(watcher.nc, s.ack("w000"))
        on_event = await _listen(watcher.nc, s.coordinator_event("x"))
        reported = await watcher.nc.subscribe(s.coordinator_event("bad_message"))
        await watcher.nc.flush()
        store = await FleetStore.open(watcher.nc, StorageConfig(fleet=stack.fleet_name))
        results_stream = f"KV_{s.results_bucket()}"
        js = watcher.nc.jetstream()
        kept_before = (await js.stream_info(results_stream)).state.messages
        pauses_before = _pauses(stack)

        for target in targets:
            await attacker.nc.publish(subject_of[kind], body, reply=target)
        await attacker.nc.flush()
        audited = [
            msgspec.json.decode((await reported.next_msg(timeout=DEADLINE_S)).data)["error"]
            for _ in targets
        ]
        # A real request on the same connection, answered: whatever the
        # coordinator published for the forged ones went out before its answer.
        await attacker.nc.request(s.status_request(), b"{}", timeout=DEADLINE_S)
        await watcher.nc.flush()

        assert _answers(on_cmd) == [] and _answers(on_ack) == [] and on_event == []
        leader, _ = await store.read_leader()
        assert leader is not None and leader.holder == stack.coordinator.holder
        assert leader.epoch == stack.coordinator.epoch == 1
        kept = await store.read_result(first.update_id)
        assert kept is not None and kept.committed and kept.version == 1
        assert (await js.stream_info(results_stream)).state.messages == kept_before
        committed = await store.read_committed("policy")
        assert committed is not None and committed.version == 1, "the forged reset ran"
        assert await store.read_result("forged") is None, "the forged update ran"
        assert _pauses(stack) == pauses_before
        assert attacker.refusals() == []

    trail = await _trail(stack)
    assert [r.subject for r in trail if r.poison] == []
    assert s.coordinator_event("x") not in {r.subject for r in trail}
    trail_audited = [
        r.message["error"]
        for r in trail
        if r.message.get("type") == "bad_message" and r.message.get("source") == "coordinator"
    ]
    assert sorted(trail_audited) == sorted(audited)
    for target in targets:
        assert any(repr(target) in error for error in audited), (target, audited)
    assert _refused(stack, kind) == len(targets)

    second = await stack.client.update("policy", make_adapter(3), version=3, timeout_s=30)
    assert second.committed, second.error


def _pauses(stack: EmbeddedStack) -> int:
    assert stack.sim is not None
    return sum(
        w.count_requests("POST", "/engine/pause_generation") for w in stack.sim.workers.values()
    )


async def test_a_fleet_of_accounts_answers_the_replies_the_server_puts_in_place(
    fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    """``lorabus auth init`` gives each role an account of its own: a request
    that crosses into the coordinator's account comes with a ``_R_.`` reply
    subject, which is answered; one aimed at the leader key is carried back
    into the requester's account and never reaches the fleet's buckets."""
    async with EmbeddedStack([1], fleet=fleet_name, secure=True, heartbeat_s=0.2) as secured:
        assert secured.client is not None and secured.coordinator is not None
        status = await secured.client.status()
        assert status.leader == secured.coordinator.holder
        s = Subjects(fleet=fleet_name)
        async with watched(secured.bus_as(Role.ORCHESTRATOR)) as orchestrator:
            target = f"$KV.{s.state_bucket()}.leader"
            await orchestrator.nc.publish(s.status_request(), b"{}", reply=target)
            await orchestrator.nc.request(s.status_request(), b"{}", timeout=DEADLINE_S)
        result = await secured.client.update("policy", make_adapter(1), version=1, timeout_s=30)
        assert result.committed, result.error
        assert secured.coordinator.epoch == 1
        assert _refused(secured, "status") == 0


async def test_answers_reach_every_kind_of_inbox(
    nats_url: str, fleet_name: str, make_stack: Callable[..., EmbeddedStack]
) -> None:
    """The default ``_INBOX.`` and a per-identity ``_INBOX_<key>.`` are answered
    (a client may not name an ``_R_.`` reply: only the server does, above)."""
    s = Subjects(fleet=fleet_name)
    async with make_stack([1]):
        nc = await connect(nats_url, name="test-requester")
        try:
            for inbox in ("_INBOX.test.1", "_INBOX_ABCDEFGHIJKLMNOP.test.1"):
                sub = await nc.subscribe(inbox)
                await nc.publish(s.status_request(), b"{}", reply=inbox)
                answer = await sub.next_msg(timeout=DEADLINE_S)
                assert _answers([answer]) == [f"fleet_status on {inbox}"]
        finally:
            await close(nc)


@pytest.mark.parametrize(
    ("reply", "refused"),
    [
        ("", False),  # no answer asked for: nothing is published
        ("_INBOX.abc", False),
        ("_INBOX_UABCDEF.abc.def", False),
        ("_R_.abc.def", False),
        ("lorabus.prod.cmd.w001", True),
        ("lorabus.prod.evt.coordinator.x", True),
        ("lorabus", True),
        ("$KV.lorabus_prod.leader", True),
        ("$JS.API.STREAM.PURGE.KV_lorabus_prod_results", True),
        ("$O.bucket.x", True),
        ("$SYS.REQ.SERVER.PING", True),
        ("other.subject", True),
        ("_INBOXES.x", True),
        ("_R_", True),
        ("_INBOX.>", True),
        ("_INBOX_COORD.abc", True),  # the coordinator's own inbox
    ],
)
def test_which_reply_subjects_are_inboxes(reply: str, refused: bool) -> None:
    why = reply_refusal(reply, Subjects(fleet="prod"), own_inbox_prefix="_INBOX_COORD")
    assert (why is not None) is refused, why


def test_a_reply_under_a_configured_prefix_is_refused_whatever_the_prefix() -> None:
    s = Subjects(fleet="prod", prefix="_INBOX_x")
    assert reply_refusal("_INBOX_x.prod.cmd.w001", s) is not None
    assert reply_refusal("_INBOX_y.1", s) is None
