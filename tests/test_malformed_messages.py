"""A malformed message on a command or request subject is reported and harms
nobody; a malformed update request is also answered ``bad_request``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from lorabus.bus.connect import close, connect
from lorabus.schemas import (
    MAX_MESSAGE_BYTES,
    BadMessage,
    ErrorCode,
    Subjects,
    event_decoder,
    update_result_decoder,
)
from lorabus.testbed.natsserver import NatsServer
from lorabus.testbed.stack import EmbeddedStack


async def test_garbage_on_the_command_subjects_is_reported_and_agents_keep_working(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    subjects = Subjects(fleet=fleet_name)
    async with make_stack([1, 2]) as stack:
        assert stack.client is not None
        nc = await connect(nats_url, name="test-saboteur")
        reports: asyncio.Queue[BadMessage] = asyncio.Queue()

        async def on_event(msg: object) -> None:
            event = event_decoder.decode(msg.data)  # type: ignore[attr-defined]
            if isinstance(event, BadMessage):
                reports.put_nowait(event)

        try:
            await nc.subscribe(subjects.event_any(), cb=on_event)
            await nc.publish(subjects.cmd(), b"{not json")
            await nc.publish(subjects.cmd_worker("w001"), b'{"type":"explode","v":1}')
            await nc.flush()
            seen = [await asyncio.wait_for(reports.get(), 10) for _ in range(3)]
        finally:
            await close(nc)

        assert {report.source for report in seen} >= {"agent:w000", "agent:w001"}
        assert all(report.error for report in seen)
        result = await stack.client.update("policy", make_adapter(1), version=1)
        assert result.committed, result.error


_REQUEST = b'"type":"update_request","v":2,"adapter":"policy","path":"/adapters/step_1"'
_DEEP = 100_000
MALFORMED_REQUESTS = {
    "not json": b"[1, 2",
    "an unknown type": b'{"type":"explode","v":2}',
    "a deeply nested unknown field": b'{%s,"update_id":"u1","junk":%s%s}'
    % (_REQUEST, b"[" * _DEEP, b"]" * _DEEP),
    "a deeply nested version": b'{%s,"update_id":"u1","version":%s%s}'
    % (_REQUEST, b"[" * _DEEP, b"]" * _DEEP),
    "an update id that is a path": b'{%s,"update_id":"../../etc"}' % _REQUEST,
    "an empty update id": b'{%s,"update_id":""}' % _REQUEST,
    "an update id of 129 characters": b'{%s,"update_id":"%s"}' % (_REQUEST, b"u" * 129),
    "a version past int64": b'{%s,"update_id":"u1","version":%d}' % (_REQUEST, 2**63),
    "a negative version": b'{%s,"update_id":"u1","version":-1}' % _REQUEST,
}


@pytest.mark.parametrize("payload", MALFORMED_REQUESTS.values(), ids=MALFORMED_REQUESTS.keys())
async def test_a_malformed_update_request_is_answered_and_reported_and_harms_nobody(
    payload: bytes,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1]) as stack:
        assert stack.client is not None
        await _answered_and_reported(nats_url, fleet_name, payload)
        result = await stack.client.update("policy", make_adapter(1), version=1, update_id="u1")

    assert result.committed, result.error


async def test_an_oversize_update_request_is_answered_and_reported_and_harms_nobody(
    tmp_path: Path,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    """On a server that lets messages past lorabus's limit through."""
    conf = tmp_path / "big-payloads.conf"
    conf.write_text(f"max_payload: {4 * MAX_MESSAGE_BYTES}\n")
    oversize = b'{%s,"update_id":"u1","v":"%s"}' % (_REQUEST, b"x" * MAX_MESSAGE_BYTES)
    async with NatsServer(include=conf) as server:
        async with EmbeddedStack([1], fleet=fleet_name, nats_url=server.url) as stack:
            assert stack.client is not None
            report = await _answered_and_reported(server.url, fleet_name, oversize)
            result = await stack.client.update("policy", make_adapter(1), version=1)

    assert str(MAX_MESSAGE_BYTES) in report.error
    assert result.committed, result.error


async def _answered_and_reported(nats_url: str, fleet_name: str, payload: bytes) -> BadMessage:
    """Send ``payload`` as an update request; check its answer, return its report."""
    subjects = Subjects(fleet=fleet_name)
    reports: asyncio.Queue[BadMessage] = asyncio.Queue()

    async def on_event(msg: Msg) -> None:
        event = event_decoder.decode(msg.data)
        if isinstance(event, BadMessage) and event.source == "coordinator":
            reports.put_nowait(event)

    nc = await connect(nats_url, name="test-saboteur")
    try:
        await nc.subscribe(subjects.event_any(), cb=on_event)
        await nc.flush()
        reply = await nc.request(subjects.update_request(), payload, timeout=10)
        report = await asyncio.wait_for(reports.get(), 10)
    finally:
        await close(nc)

    answer = update_result_decoder.decode(reply.data)
    assert answer.status == "failed" and answer.update_id == "", answer
    assert answer.error is not None and answer.error.code == ErrorCode.BAD_REQUEST
    assert answer.error.message.startswith("malformed update request: "), answer.error
    assert report.subject == subjects.update_request()
    assert report.size == len(payload) and report.error == answer.error.message
    return report
