"""A malformed message on a command subject is reported and harms nobody."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lorabus.bus import close, connect
from lorabus.schemas import BadMessage, Subjects, event_decoder
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


async def test_a_malformed_update_request_gets_a_bad_request_answer(
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1]) as stack:
        assert stack.client is not None
        reply = await stack.client.nc.request(
            Subjects(fleet=fleet_name).update_request(), b"[1, 2", timeout=10
        )
        assert b"bad_request" in reply.data
        assert b"malformed update request" in reply.data
