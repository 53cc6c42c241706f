"""No identity can change how the fleet's streams are set, and a leader says
when somebody has.

Whoever may update a stream's configuration can aim JetStream: republish
what the audit stream stores onto the leader key, seal a bucket, stop the
direct reads the tap lives on, or have JetStream answer an agent's ack with
"stored" wherever its reply subject points. With the accounts of ``lorabus
auth init`` the operator may create the streams and read their settings,
not change them: every such update is refused by the server, nothing
changes, and the next update commits. ``lorabus provision`` as the operator
is a no-op on a fleet already set so, and says what to do on one set
otherwise. A coordinator that takes office finds and audits what another
hand set.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest
from nats.js.api import RePublish, StreamConfig
from processes import run_lorabus
from secured import watched

from lorabus.bus.connect import close, connect
from lorabus.coordinator.config import StorageConfig
from lorabus.coordinator.streams import (
    StreamChangeRefused,
    fleet_streams,
    provision,
    unsafe_settings,
)
from lorabus.schemas import BadMessage, Subjects, event_decoder
from lorabus.security.roles import FLEET_JS_API, Role
from lorabus.testbed.natsserver import NatsServer, free_port
from lorabus.testbed.stack import EmbeddedStack

WORKERS = ("w000", "w001")


def _aimed(config: StreamConfig, s: Subjects) -> list[StreamConfig]:
    """What an attacker would make of one of the fleet's streams."""
    leader_key = f"$KV.{s.state_bucket()}.leader"
    return [
        dataclasses.replace(config, republish=RePublish(src=">", dest=leader_key)),
        dataclasses.replace(config, sealed=True),
        dataclasses.replace(config, allow_direct=False, no_ack=False),
        dataclasses.replace(config, max_bytes=1 << 20, max_age=60.0),
    ]


async def _settings(stack: EmbeddedStack) -> dict[str, StreamConfig]:
    nc = await stack.bus_as(Role.COORDINATOR).connect("test-observer")
    try:
        js = nc.jetstream()
        names = [str(c.name) for c in fleet_streams(StorageConfig(fleet=stack.fleet_name))]
        return {name: (await js.stream_info(name)).config for name in names}
    finally:
        await close(nc)


async def test_no_role_can_change_a_stream_and_provision_says_so(
    secured_stack: EmbeddedStack, make_adapter: Callable[[int], str]
) -> None:
    stack = secured_stack
    assert stack.client is not None
    s = Subjects(fleet=stack.fleet_name)
    first = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
    assert first.committed, first.error
    before = await _settings(stack)

    for role in Role:
        worker = {Role.AGENT: "w000", Role.TENANT: "a", Role.NODE: "n0"}.get(role)
        api = "$JS.API" if role is Role.COORDINATOR else FLEET_JS_API
        async with watched(stack.bus_as(role, worker)) as attacker:
            for config in fleet_streams(StorageConfig(fleet=stack.fleet_name)):
                subject = f"{api}.STREAM.UPDATE.{config.name}"
                for aimed in _aimed(config, s):
                    await attacker.nc.publish(subject, json.dumps(aimed.as_dict()).encode())
                await attacker.wait_refusal("publish", subject)

    # The operator sets a fleet up once; on one set so already it changes
    # nothing, and on one set otherwise it says why it cannot.
    nc = await stack.bus_as(Role.OPERATOR).connect("test-operator")
    try:
        assert await provision(nc, StorageConfig(fleet=stack.fleet_name)) == []
        with pytest.raises(StreamChangeRefused, match="may not change a stream's configuration"):
            await provision(nc, StorageConfig(fleet=stack.fleet_name, audit_max_bytes=1 << 20))
    finally:
        await close(nc)

    assert await _settings(stack) == before
    second = await stack.client.update("policy", make_adapter(2), version=2, timeout_s=30)
    assert second.committed, second.error


async def test_a_new_leader_audits_stream_settings_lorabus_would_not_make(
    nats_url: str,
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
    make_adapter: Callable[[int], str],
) -> None:
    """On a server without roles, where anyone may: the streams as lorabus
    sets them up, then the audit stream made to republish and answer acks,
    the state bucket to republish, and the adapter store to take rollups
    (which would let a publish remove its objects)."""
    s = Subjects(fleet=fleet_name)
    storage = StorageConfig(fleet=fleet_name)
    state, results, store, audit = fleet_streams(storage)
    nc = await connect(nats_url, name="test-another-hand")
    try:
        assert set(await provision(nc, storage)) <= {state.name, results.name, audit.name}
        js = nc.jetstream()
        await js.update_stream(
            dataclasses.replace(
                audit, republish=RePublish(src=">", dest=f"{fleet_name}.copied.>"), no_ack=False
            )
        )
        await js.update_stream(
            dataclasses.replace(state, republish=RePublish(src=">", dest=f"{fleet_name}.kv.>"))
        )
        await js.update_stream(dataclasses.replace(store, allow_rollup_hdrs=True))
        heard = await nc.subscribe(s.coordinator_event("bad_message"))
        await nc.flush()

        async with make_stack([1]) as stack:
            assert stack.client is not None
            said = []
            while len(said) < 4:
                message = await heard.next_msg(timeout=15)
                event = event_decoder.decode(message.data)
                assert isinstance(event, BadMessage)
                said.append(event.error)
            result = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
            assert result.committed, result.error

        assert any(f"stream {audit.name}: republish" in e for e in said), said
        assert any(f"stream {audit.name}: no_ack is False, lorabus sets True" in e for e in said)
        assert any(f"stream {state.name}: republish" in e for e in said), said
        rollups = f"stream {store.name}: allow_rollup_hdrs is True, lorabus sets False"
        assert any(rollups in e for e in said), said
        # lorabus provision, where it may, puts them back.
        assert set(await provision(nc, storage)) == {state.name, audit.name, store.name}
        assert await unsafe_settings(js, storage) == []
    finally:
        await close(nc)


async def test_provision_on_a_cluster_without_its_jetstream_leader_says_so_in_one_line() -> None:
    """A node whose peers do not answer yet (a compose cluster coming up) has
    no JetStream leader and answers no JetStream request: ``lorabus provision``
    says so and exits 1, for compose to start it again, with no traceback."""
    lone = NatsServer(name="n1", cluster_port=free_port(), routes=[free_port(), free_port()])
    async with lone:
        done = await run_lorabus("provision", "--nats", lone.url, "--fleet", "f")

    assert done.returncode == 1, done
    assert "error: stream KV_lorabus_f could not be made: JetStream did not answer" in (
        done.stderr
    ), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
