"""The orchestrator's client reports an absent coordinator instead of hanging,
asks again when a leader that took its request never answers, and turns a
reply that does not decode into a LorabusError."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from nats.aio.msg import Msg

from lorabus.bus.connect import close, connect
from lorabus.client import UpdateClient
from lorabus.errors import LorabusError, MalformedReply, NoCoordinator
from lorabus.schemas import Subjects, UpdateRequest, update_request_decoder
from lorabus.testbed.stack import EmbeddedStack


async def test_no_coordinator_is_a_failed_result_with_its_own_code(
    nats_url: str, fleet_name: str
) -> None:
    nc = await connect(nats_url, name="test-client")
    try:
        client = UpdateClient(nc, fleet_name, no_coordinator_wait_s=0.3)
        result = await client.update("policy", "/a/step_1", version=1, update_id="lonely")
        with pytest.raises(NoCoordinator, match=fleet_name):
            await client.status()
    finally:
        await close(nc)

    assert result.status == "failed" and result.update_id == "lonely"
    assert result.error is not None and result.error.code == "no_coordinator"
    assert fleet_name in result.error.message


async def test_a_request_a_dead_leader_took_is_asked_again_and_answered_by_its_successor(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    """The request reaches a leader that never answers (killed right after it
    took it); no coordinator listens for a while; then a successor does."""
    nc = await connect(nats_url, name="test-dead-leader")
    taken: asyncio.Queue[UpdateRequest] = asyncio.Queue()

    async def take_and_die(msg: Msg) -> None:
        taken.put_nowait(update_request_decoder.decode(msg.data))

    dead_leader = await nc.subscribe(Subjects(fleet=fleet_name).update_request(), cb=take_and_die)
    await nc.flush()
    client = UpdateClient(nc, fleet_name, reask_s=0.5)
    try:
        asking = asyncio.create_task(
            client.update("policy", make_adapter(1), version=1, update_id="u1", timeout_s=60)
        )
        first = await asyncio.wait_for(taken.get(), 10)
        await dead_leader.unsubscribe()
        async with make_stack([1, 2]):
            result = await asyncio.wait_for(asking, 60)
    finally:
        await close(nc)

    assert first.update_id == "u1"
    assert result.committed, result.error
    assert result.update_id == "u1" and result.adapter == "policy-v1"


async def test_a_request_nobody_answers_times_out_naming_its_update_id(
    nats_url: str, fleet_name: str
) -> None:
    nc = await connect(nats_url, name="test-silent-leader")

    async def never_answer(msg: Msg) -> None:
        return None

    await nc.subscribe(Subjects(fleet=fleet_name).update_request(), cb=never_answer)
    await nc.flush()
    try:
        client = UpdateClient(nc, fleet_name, reask_s=0.2)
        result = await client.update("policy", "/a/step_1", update_id="u9", timeout_s=1)
    finally:
        await close(nc)

    assert result.error is not None and result.error.code == "timeout"
    assert "update_id u9" in result.error.message


@pytest.mark.parametrize(
    "reply",
    [b"{not json", b'{"type":"update_result","v":2,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"],
    ids=["not json", "nested too deeply"],
)
async def test_a_malformed_reply_is_a_clear_lorabus_error(
    nats_url: str, fleet_name: str, reply: bytes
) -> None:
    """Whatever answers on the request subjects (a rogue responder here) cannot
    make the client raise anything but a LorabusError that says what happened."""
    nc = await connect(nats_url, name="test-rogue-responder")
    subjects = Subjects(fleet=fleet_name)

    async def answer_junk(msg: Msg) -> None:
        await msg.respond(reply)

    await nc.subscribe(subjects.update_request(), cb=answer_junk)
    await nc.subscribe(subjects.status_request(), cb=answer_junk)
    await nc.flush()
    try:
        client = UpdateClient(nc, fleet_name)
        with pytest.raises(MalformedReply, match="not a valid update result") as updating:
            await client.update("policy", "/a/step_1", version=1, timeout_s=5)
        with pytest.raises(MalformedReply, match="not a valid fleet status"):
            await client.status()
    finally:
        await close(nc)

    assert isinstance(updating.value, LorabusError)
    assert subjects.update_request() in str(updating.value)
