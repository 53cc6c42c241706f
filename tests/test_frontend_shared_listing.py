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

    async def models_route(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await asyncio.sleep(LISTING_S)
            data = [{"id": name} for name in sorted(self.models)]
        finally:
            self.open -= 1
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
