"""Only the leader deletes from the adapter store. Every other role tries
every way NATS offers to remove or replace an object: a rollup header on a
chunk (``all``) or on a meta record (``sub``), a meta record marked deleted,
the purge, message-delete, stream-delete and stream-update API calls. Each
is refused, by the role's permissions or by the stream's settings, and the
object is still there, whole.

Against a real nats-server started from ``lorabus auth init``'s
configuration (static accounts and operator JWTs), every part as its own
identity.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Callable

import pytest
from nats.aio.msg import Msg
from processes import run_lorabus
from secured import DEADLINE_S, Watched, watched

from lorabus.adapters.fetch import fetch_object
from lorabus.adapters.store import store_config
from lorabus.bus.connect import close
from lorabus.schemas import Subjects
from lorabus.security.accounts import js_api_prefix
from lorabus.security.roles import Role
from lorabus.testbed.stack import EmbeddedStack

ROLES = [
    Role.AGENT,
    Role.COORDINATOR,
    Role.ORCHESTRATOR,
    Role.AUDITOR,
    Role.OPERATOR,
    Role.TENANT,
]
_AS = {Role.AGENT: "w000", Role.TENANT: "a"}
"""Who of a role makes the attempts: an agent of a worker, a tenant."""


def _attempts(
    subjects: Subjects, api: str, digest: str, meta: dict[str, object]
) -> list[tuple[str, bytes, dict[str, str] | None]]:
    """Every way to remove or replace the object of ``digest`` through NATS."""
    bucket = subjects.adapter_store()
    stream = f"OBJ_{bucket}"
    meta_subject = f"$O.{bucket}.M.{base64.urlsafe_b64encode(digest.encode()).decode()}"
    deleted = json.dumps({**meta, "deleted": True, "size": 0, "chunks": 0}).encode()
    lax = store_config(subjects).as_dict() | {"allow_rollup_hdrs": True, "max_msgs_per_subject": -1}
    return [
        (f"$O.{bucket}.C.{'0' * 64}.forged.0", b"", {"Nats-Rollup": "all"}),
        (f"$O.{bucket}.C.{digest.removeprefix('sha256:')}.{meta['nuid']}.0", b"", None),
        (
            f"$O.{bucket}.C.{digest.removeprefix('sha256:')}.{meta['nuid']}.0",
            b"",
            {"Nats-Rollup": "sub"},
        ),
        (meta_subject, deleted, {"Nats-Rollup": "sub"}),
        (meta_subject, deleted, None),
        (f"{api}.STREAM.MSG.DELETE.{stream}", json.dumps({"seq": 1}).encode(), None),
        (f"{api}.STREAM.DELETE.{stream}", b"", None),
        (f"{api}.STREAM.UPDATE.{stream}", json.dumps(lax).encode(), None),
        # Purging is the leader's way to delete: the coordinator may.
        (f"{api}.STREAM.PURGE.{stream}", b"{}", None),
        (f"{api}.STREAM.PURGE.{stream}", json.dumps({"filter": meta_subject}).encode(), None),
    ]


async def _answers(
    client: Watched, attempts: list[tuple[str, bytes, dict[str, str] | None]]
) -> list[str]:
    """Make every attempt at once and return how each was refused: the
    server's refusal of the publish (the role's permissions), or JetStream's
    answer. An attempt that gets neither fails the test at the deadline."""
    inbox = client.nc.new_inbox()
    replies: dict[int, str] = {}

    async def on_reply(msg: Msg) -> None:
        replies[int(msg.subject.rpartition(".")[2])] = msg.data.decode(errors="replace")

    await client.nc.subscribe(f"{inbox}.*", cb=on_reply)
    for i, (subject, data, headers) in enumerate(attempts):
        await client.nc.publish(subject, data, reply=f"{inbox}.{i}", headers=headers)
    await client.nc.flush()

    def answer(i: int, subject: str) -> str | None:
        refused = f'permissions violation for publish to "{subject}"'.lower()
        if any(refused in error.lower() for error in client.errors):
            return "refused by its permissions"
        return replies.get(i)

    async with asyncio.timeout(DEADLINE_S):
        while None in (found := [answer(i, a[0]) for i, a in enumerate(attempts)]):  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    return [str(a) for a in found]


@pytest.mark.parametrize("role", ROLES)
async def test_no_role_but_the_coordinator_can_remove_or_replace_an_object(
    secured_stack: EmbeddedStack, role: Role, make_adapter: Callable[[int], str]
) -> None:
    stack = secured_stack
    assert stack.client is not None
    # A tenant attacks the store it may write, its own; the others the fleet's.
    own = role is Role.TENANT
    fleet_subjects = Subjects(fleet=stack.fleet_name)
    subjects = fleet_subjects.for_store("a") if own else fleet_subjects
    stream = f"OBJ_{subjects.adapter_store()}"
    pusher = await stack.client_as("a") if own else stack.client
    digest = await pusher.push_adapter(make_adapter(1))
    reader = await stack.bus_as(Role.OPERATOR).connect("test-store-reader")
    try:
        before = (await reader.jetstream().stream_info(stream)).state.messages
        meta_subject = (
            f"$O.{subjects.adapter_store()}.M.{base64.urlsafe_b64encode(digest.encode()).decode()}"
        )
        found = await reader.request(
            f"{js_api_prefix(Role.OPERATOR)}.DIRECT.GET.{stream}.{meta_subject}", b"", timeout=5
        )
        meta = json.loads(found.data)
        api = js_api_prefix(role) or "$JS.API"
        attempts = _attempts(subjects, api, digest, meta)
        if role is Role.COORDINATOR:
            attempts = [a for a in attempts if ".STREAM.PURGE." not in a[0]]
        async with watched(stack.bus_as(role, _AS.get(role))) as client:
            answers = await _answers(client, attempts)
        after = (await reader.jetstream().stream_info(stream)).state.messages
        into = io.BytesIO()
        size = await fetch_object(reader, subjects, digest, into, timeout_s=10, max_bytes=1 << 30)
    finally:
        await close(reader)

    # Refused, by the permissions or by JetStream (an error).
    assert all(a == "refused by its permissions" or '"error"' in a for a in answers), answers
    assert after == before
    assert size == into.tell() > 0
    policy = "a-policy" if own else "policy"
    result = await pusher.update(policy, digest=digest, version=1, timeout_s=30)
    assert result.committed, result.error


async def test_the_operator_lists_what_the_store_holds_and_what_keeps_it(
    fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    """``lorabus adapter list`` as the operator: each object, its size and what
    keeps it; one nothing keeps is said to be so. As the orchestrator (which
    may not read the state bucket) the objects alone, saying why."""
    async with EmbeddedStack([1], fleet=fleet_name, secure=True, heartbeat_s=0.2) as stack:
        assert stack.client is not None and stack.auth is not None
        committed = await stack.client.push_adapter(make_adapter(1))
        orphan = await stack.client.push_adapter(make_adapter(2))
        result = await stack.client.update("policy", digest=committed, version=1, timeout_s=30)
        listed = {}
        for role in (Role.OPERATOR, Role.ORCHESTRATOR):
            listed[role] = await run_lorabus(
                "--identity",
                str(stack.auth.identity(role).folder),
                "adapter",
                "list",
                "--nats",
                stack.nats_url,
                "--fleet",
                fleet_name,
                "--json",
            )

    assert result.committed, result.error
    by_operator = json.loads(listed[Role.OPERATOR].stdout)
    kept = {o["digest"]: o["kept_by"] for o in by_operator["objects"]}
    assert kept == {committed: ["policy v1 committed"], orphan: []}, by_operator
    by_orchestrator = listed[Role.ORCHESTRATOR]
    assert by_orchestrator.returncode == 0, by_orchestrator
    assert {o["digest"] for o in json.loads(by_orchestrator.stdout)["objects"]} == {
        committed,
        orphan,
    }
    assert "what keeps each object is not known" in by_orchestrator.stderr
