"""An engine call whose connection hangs is tried again within the budget.

The engine is beside its agent, so a connection that does not open within
seconds hangs: a SYN dropped by a full accept queue (an engine too busy to
accept), a name lookup a DNS server dropped. Such a call times out on its
own connect timeout, shorter than the call's, and the retry policy asks
again within the caller's budget, instead of one hung connect taking the
whole phase. The hang is real: a listening socket whose accept queue is
full, so the kernel drops the next SYN.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from aiohttp import web

from lorabus.agents.http_engine import HttpEngine
from lorabus.errors import EngineError

DEADLINE_S = 10.0
"""Fails the test instead of hanging: the call's own timeout is 30 s."""

# A full accept queue drops the next SYN on Linux; elsewhere it may refuse it.
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux's accept queue")


@contextmanager
def listener_that_never_accepts() -> Iterator[str]:
    """A URL whose port takes no more connections: its queue is full."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):  # the queue holds backlog + 1; the rest wait in SYN-SENT
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", port))
            fillers.append(filler)
        probe = socket.socket()
        probe.settimeout(0.3)
        with pytest.raises(TimeoutError):  # the premise: a connect here hangs
            probe.connect(("127.0.0.1", port))
        probe.close()
        yield f"http://127.0.0.1:{port}"
    finally:
        for filler in fillers:
            filler.close()
        server.close()


async def test_a_connect_that_hangs_is_tried_again_within_the_budget() -> None:
    with listener_that_never_accepts() as url:
        engine = HttpEngine(url, timeout_s=30, connect_timeout_s=0.2, attempts=3)
        try:
            async with asyncio.timeout(DEADLINE_S):
                with pytest.raises(EngineError) as failed:
                    await engine.retrying(lambda: engine.send("GET", "/v1/models"), 30)
        finally:
            await engine.aclose()

    assert failed.value.retryable
    assert "ConnectTimeout" in str(failed.value)
    assert "gave up after 3 attempts" in str(failed.value)


async def test_the_short_connect_timeout_does_not_cut_a_slow_answer() -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(2.0)  # longer than the connect timeout
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_get("/v1/models", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    engine = HttpEngine(f"http://127.0.0.1:{port}", timeout_s=30, connect_timeout_s=1.0)
    try:
        async with asyncio.timeout(DEADLINE_S):
            answer = await engine.send("GET", "/v1/models")
    finally:
        await engine.aclose()
        await runner.cleanup()

    assert answer.status_code == 200 and answer.json() == {"object": "list", "data": []}
