"""Concurrent verifies share the frontend's listing: a real HTTP server counts
how many ``/v1/models`` requests are open at once. Updates of different
adapters verify together; each used to poll on its own, and 32 at once
queued for the client's connections until they timed out."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from lorabus.coordinator.frontend import FrontendClient
from lorabus.errors import FrontendUnverified
from lorabus.testbed.natsserver import free_port

LISTING_S = 0.05
"""Each listing takes this long: polls overlap unless they are shared."""


class _Frontend:
    def __init__(self) -> None:
        self.models: set[str] = set()
        self.open = 0
        self.most_open = 0
        self.requests = 0
        self.answered = 0
        self.cut = 0
        self.hold = asyncio.Event()
        self.hold.set()

    async def models_route(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await asyncio.sleep(LISTING_S)
            await self.hold.wait()
            data = [{"id": name} for name in sorted(self.models)]
        finally:
            self.open -= 1
        if request.transport is None or request.transport.is_closing():
            self.cut += 1  # the client gave the request up
        else:
            self.answered += 1
        return web.json_response({"object": "list", "data": data})


@pytest.fixture
async def frontend() -> AsyncIterator[tuple[_Frontend, str]]:
    served = _Frontend()
    app = web.Application()
    app.router.add_get("/v1/models", served.models_route)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield served, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_many_verifies_at_once_send_one_listing_at_a_time(
    frontend: tuple[_Frontend, str],
) -> None:
    served, url = frontend
    client = FrontendClient(url, timeout_s=5)
    names = [f"tenant-{n}-v1" for n in range(32)]
    try:
        waiting = [asyncio.create_task(client.wait_listed(name, 20)) for name in names]
        await asyncio.sleep(0.3)
        assert not any(task.done() for task in waiting)
        for name in names:
            served.models.add(name)
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*waiting), 30)
        with pytest.raises(FrontendUnverified):
            await client.wait_listed("never-v1", 0.5)
    finally:
        await client.aclose()

    assert served.most_open == 1, "the polls of the verifies were not shared"
    assert served.requests < len(names), served.requests


async def test_a_verify_cancelled_mid_request_leaves_the_request_to_finish(
    frontend: tuple[_Frontend, str],
) -> None:
    """A verify's look is dropped once the last load is acked, often with its
    request under way. Cut mid-request, httpx's pool sometimes kept the
    connection busy for good, and after enough of them every poll failed
    (PoolTimeout) and every update with it. The request now finishes."""
    served, url = frontend
    served.hold.clear()
    client = FrontendClient(url, timeout_s=5)
    try:
        look = asyncio.create_task(client.wait_listed("tenant-1-v1", 20))
        async with asyncio.timeout(10):
            while served.open == 0:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        look.cancel()
        await asyncio.gather(look, return_exceptions=True)
        served.hold.set()
        async with asyncio.timeout(10):
            while served.answered + served.cut == 0 and served.open:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert (served.answered, served.cut) == (1, 0), "the request was given up"
        served.models.add("tenant-1-v1")
        assert await client.wait_listed("tenant-1-v1", 5) >= 0
    finally:
        await client.aclose()
