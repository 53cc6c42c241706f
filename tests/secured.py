"""Connections that record what the server refused, for the security tests.

A :class:`Watched` connection is made with an identity's real options
(``BusOptions.nats_kwargs``, as every lorabus process makes its own) and
keeps every error the server reports asynchronously, so that a test can wait
for the one refusal it expects instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import nats

from lorabus.bus.connect import Bus, FleetConnection

DEADLINE_S = 10.0


class Watched:
    def __init__(self, js_api_prefix: str | None = None) -> None:
        self.nc = FleetConnection(js_api_prefix)
        self.errors: list[str] = []
        self._changed = asyncio.Event()

    async def _on_error(self, exc: Exception) -> None:
        self.errors.append(str(exc))
        self._changed.set()

    async def wait_refusal(self, verb: str, subject: str) -> str:
        """The server's refusal of ``verb`` (``publish`` or ``subscription``) to ``subject``."""
        wanted = f'permissions violation for {verb} to "{subject}"'.lower()
        async with asyncio.timeout(DEADLINE_S):
            while True:
                found = next((e for e in self.errors if wanted in e.lower()), None)
                if found is not None:
                    return found
                self._changed.clear()
                await self._changed.wait()

    def refusals(self) -> list[str]:
        return [e for e in self.errors if "permissions violation" in e.lower()]


@contextlib.asynccontextmanager
async def watched(bus: Bus) -> AsyncIterator[Watched]:
    """A connection as ``bus``'s identity, closed on exit."""
    client = Watched(bus.options.js_api_prefix)
    servers = [part.strip() for part in bus.url.split(",")]
    await asyncio.wait_for(
        client.nc.connect(
            servers=servers,
            error_cb=client._on_error,
            allow_reconnect=False,
            connect_timeout=5,
            **bus.options.nats_kwargs(servers),
        ),
        DEADLINE_S,
    )
    try:
        yield client
    finally:
        with contextlib.suppress(nats.errors.Error, OSError):
            await client.nc.close()
