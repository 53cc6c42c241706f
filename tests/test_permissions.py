"""Only the right role may speak: the permission matrix of ``lorabus auth init``,
checked against a real nats-server started from the generated configuration.

For every role, each publish and subscribe it must not make is refused by the
server, by name, and changes nothing: no engine of the simulated fleet
pauses, the coordinator keeps leading, and the next update commits. Each
thing a role must do still works.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from secured import watched

from lorabus.audit.tap import Tap
from lorabus.audit.verify import TrailRecord
from lorabus.bus.connect import close
from lorabus.operator import reset_committed
from lorabus.schemas import PauseCommand, Subjects, encode
from lorabus.security.roles import Role
from lorabus.testbed.stack import EmbeddedStack

WORKERS = ("w000", "w001")
FORGED_PAUSE = PauseCommand(
    update_id="forged", targets=list(WORKERS), budget_s=30, epoch=1_000_000, lease_s=0
)


def _forbidden(role: Role, s: Subjects, inboxes: dict[Role, str]) -> dict[str, list[str]]:
    """What ``role`` must not publish or subscribe to (other roles' inboxes included)."""
    state, audit = s.state_bucket(), s.audit_stream()
    erase = [f"$JS.API.STREAM.DELETE.{audit}", f"$JS.API.STREAM.PURGE.{audit}"]
    kv_write = [f"$KV.{state}.leader", f"$KV.{state}.committed"]
    commands = [s.cmd(), s.cmd_worker("w000"), s.cmd_worker("w001")]
    # Only the orchestrator pushes adapters; only the leader deletes them.
    store = s.adapter_store()
    object_writes = [f"$O.{store}.C.forged", f"$O.{store}.M.forged"]
    object_erase = [f"$JS.API.STREAM.PURGE.OBJ_{store}", f"$JS.API.STREAM.DELETE.OBJ_{store}"]
    others = [f"{prefix}.x" for other, prefix in inboxes.items() if other is not role]
    if role is Role.AGENT:  # the agent of w000
        return {
            "publish": [
                *commands,
                s.ack("w001"),
                s.heartbeat("w001"),
                s.agent_event("w001", "lease_expired"),
                s.coordinator_event("leader_elected"),
                s.update_request(),
                s.reset_request(),
                *kv_write,
                *erase,
                *object_writes,
                *object_erase,
            ],
            "subscription": [s.cmd_worker("w001"), s.ack_any(), s.update_request(), *others],
        }
    if role is Role.NODE:  # node n0, of worker w900
        return {
            "publish": [
                *commands,
                s.ack("w000"),
                s.ack("w900"),
                s.heartbeat("w900"),
                s.ack("n1"),
                s.agent_event("w000", "lease_expired"),
                s.coordinator_event("leader_elected"),
                s.update_request(),
                s.reset_request(),
                *kv_write,
                *erase,
                *object_writes,
                *object_erase,
            ],
            "subscription": [s.cmd_worker("w000"), s.ack_any(), s.heartbeat_any(), *others],
        }
    if role is Role.TENANT:  # tenant a
        return {
            "publish": [
                *commands,
                s.ack("w000"),
                s.heartbeat("w000"),
                s.coordinator_event("update_finished"),
                s.update_request(),
                s.status_request(),
                s.result_request(),
                s.reset_request(),
                s.tenant_request("b", "update"),
                s.tenant_request("b", "result"),
                *kv_write,
                *erase,
                *object_erase,
            ],
            "subscription": [
                s.cmd(),
                s.heartbeat_any(),
                s.tenant_request_any("update"),
                s.tenant_request("a", "update"),
                *others,
            ],
        }
    if role is Role.COORDINATOR:
        return {
            "publish": [
                s.ack("w000"),
                s.heartbeat("w000"),
                s.agent_event("w000", "reconciled"),
                s.update_request(),
                s.reset_request(),
                f"$JS.API.STREAM.UPDATE.{audit}",
                *erase,
                # It deletes objects nothing keeps, but writes none.
                *object_writes,
                f"$JS.API.STREAM.DELETE.OBJ_{store}",
            ],
            "subscription": [s.cmd(), *others],
        }
    return {
        "publish": [
            *commands,
            s.ack("w000"),
            s.heartbeat("w000"),
            s.coordinator_event("update_finished"),
            *([] if role is Role.ORCHESTRATOR else [s.update_request()]),
            *([] if role is Role.OPERATOR else [s.reset_request()]),
            s.tenant_request("a", "update"),
            *kv_write,
            *erase,
            *([] if role is Role.ORCHESTRATOR else object_writes),
            *object_erase,
        ],
        # The orchestrator and the operator may hear heartbeats (``lorabus status``
        # without a coordinator); the auditor may not.
        "subscription": [
            s.cmd(),
            s.update_request(),
            *([] if role in _HEAR_HEARTBEATS else [s.heartbeat_any()]),
            *others,
        ],
    }


_HEAR_HEARTBEATS = (Role.ORCHESTRATOR, Role.OPERATOR)


@pytest.fixture
def stack(secured_stack: EmbeddedStack) -> EmbeddedStack:
    return secured_stack


_AS = {Role.AGENT: "w000", Role.TENANT: "a", Role.NODE: "n0"}
"""Who of a role: the agent of w000, tenant a, node n0 (of worker w900)."""


@pytest.mark.parametrize("role", list(Role))
async def test_every_forbidden_publish_and_subscribe_is_refused_and_changes_nothing(
    stack: EmbeddedStack, role: Role, make_adapter: Callable[[int], str]
) -> None:
    assert stack.auth is not None and stack.sim is not None and stack.client is not None
    subjects = Subjects(fleet=stack.fleet_name)
    inboxes = {r: stack.auth.identity(r, _AS.get(r)).inbox_prefix for r in Role}
    forbidden = _forbidden(role, subjects, inboxes)
    pauses_before = sum(
        w.count_requests("POST", "/engine/pause_generation") for w in stack.sim.workers.values()
    )

    async with watched(stack.bus_as(role, _AS.get(role))) as client:
        for subject in forbidden["subscription"]:
            await client.nc.subscribe(subject)
        for subject in forbidden["publish"]:
            await client.nc.publish(subject, encode(FORGED_PAUSE))
        await client.nc.flush()
        for verb, refused in forbidden.items():
            for subject in refused:
                await client.wait_refusal(verb, subject)

    pauses_after = sum(
        w.count_requests("POST", "/engine/pause_generation") for w in stack.sim.workers.values()
    )
    assert pauses_after == pauses_before, "a forged pause reached an engine"
    assert not any(w.paused for w in stack.sim.workers.values())
    assert stack.coordinator is not None and stack.coordinator.epoch == 1
    result = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
    assert result.committed, result.error


async def test_each_role_can_do_its_own_work(
    stack: EmbeddedStack, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None
    subjects = Subjects(fleet=stack.fleet_name)
    # The orchestrator: updates and status (its client runs as the orchestrator).
    result = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
    assert result.committed, result.error
    status = await stack.client.status()
    assert [m.worker_id for m in status.members] == list(WORKERS)
    # ... and fetch that update's outcome by its id (``lorabus result``).
    outcome = await stack.client.result(result.update_id, timeout_s=10)
    assert outcome.status == "committed", outcome

    # ... and push an adapter to the object store, which the agents fetch.
    digest = await stack.client.push_adapter(make_adapter(2))
    pushed = await stack.client.update("policy", digest=digest, version=2, timeout_s=30)
    assert pushed.committed and pushed.digest == digest, pushed.error

    # The auditor reads the trail of that update.
    records: list[TrailRecord] = []

    async def keep(record: TrailRecord) -> None:
        records.append(record)

    nc = await stack.bus_as(Role.AUDITOR).connect("test-auditor")
    try:
        await Tap(nc, subjects).run(keep, follow=False)
    finally:
        await close(nc)
    assert any(r.message.get("update_id") == result.update_id for r in records)

    # An agent may beat on its own subject; the operator may set the fleet up again.
    async with watched(stack.bus_as(Role.AGENT, "w000")) as agent:
        await agent.nc.publish(subjects.heartbeat("w000"), b"{}")
        await agent.nc.flush()
        assert agent.refusals() == []
    # The orchestrator and the operator may hear heartbeats (``lorabus status``
    # when no coordinator answers).
    for role in _HEAR_HEARTBEATS:
        async with watched(stack.bus_as(role)) as listener:
            await listener.nc.subscribe(subjects.heartbeat_any())
            await listener.nc.flush()
            await listener.nc.request(subjects.status_request(), b"{}", timeout=10)
            assert listener.refusals() == [], role
    async with watched(stack.bus_as(Role.OPERATOR)) as operator:
        info = await operator.nc.jetstream().stream_info(subjects.audit_stream())
        assert info.config.deny_delete and info.config.deny_purge
        # ... and reset an adapter's committed state (the coordinator answers).
        reset = await reset_committed(
            operator.nc, subjects, "policy", "permissions test", expected_version=0
        )
        assert reset.error is not None and "not 0" in reset.error.message, reset
        assert operator.refusals() == []
