"""A partition between one process and the bus: a TCP proxy that stops forwarding.

Every agent and coordinator of a chaos run reaches nats-server through a
:class:`LinkProxy` of its own, so one process's link can be cut without
touching the others'. A cut stops forwarding in one direction or both and
closes nothing: the bytes wait (in the proxy and in the kernels' buffers)
as on a link that drops every packet while TCP retransmits, and flow again,
in order, once healed. A cut longer than the clients' ping bound ends as it
would on a real network: the client gives the connection up and reconnects,
through the same proxy, still cut until healed.

The same proxy stands between the nodes of a cluster-mode run, one per route
direction, so a node can be cut off from the others. A proxy may forward to
one of several upstreams (a process's home node first, the other nodes when
it is down or cut off): each new connection goes to the first that the
``upstreams`` callable names and that accepts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

_READ_BYTES = 64 << 10


class LinkProxy:
    """Forwards 127.0.0.1:<port> to nats-server's port; see the module docstring."""

    def __init__(self, upstream: int | Callable[[], list[int]]) -> None:
        if callable(upstream):
            self._upstreams = upstream
        else:
            self._upstreams = lambda: [upstream]
        self.port = 0
        self._live: dict[asyncio.StreamWriter, int] = {}
        """Each connection forwarded, by the upstream port it reached."""
        self._to_bus = asyncio.Event()
        self._from_bus = asyncio.Event()
        self._to_bus.set()
        self._from_bus.set()
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def reaches(self, upstream_port: int) -> bool:
        """Whether a connection through this proxy is forwarded to ``upstream_port`` now."""
        return upstream_port in self._live.values()

    @property
    def is_cut(self) -> bool:
        return not (self._to_bus.is_set() and self._from_bus.is_set())

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def cut(self, *, to_bus: bool = True, from_bus: bool = True) -> None:
        """Stop forwarding what the process sends (``to_bus``), what it is sent
        (``from_bus``), or both."""
        if to_bus:
            self._to_bus.clear()
        if from_bus:
            self._from_bus.clear()

    def heal(self) -> None:
        self._to_bus.set()
        self._from_bus.set()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        for port in self._upstreams():
            try:
                bus_r, bus_w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
            except (OSError, TimeoutError):
                continue
            break
        else:  # every nats-server it may reach is down: so is the link
            client_w.close()
            return
        self._writers.update((client_w, bus_w))
        self._live[client_w] = port
        for reader, writer, flowing in (
            (client_r, bus_w, self._to_bus),
            (bus_r, client_w, self._from_bus),
        ):
            pump = asyncio.create_task(self._pump(reader, writer, flowing, (client_w, bus_w)))
            self._pumps.add(pump)
            pump.add_done_callback(self._pumps.discard)

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        flowing: asyncio.Event,
        ends: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        try:
            while data := await reader.read(_READ_BYTES):
                await flowing.wait()  # held while cut; reading stops, the sender's buffers fill
                writer.write(data)
                await writer.drain()
        except (OSError, ConnectionError) as exc:
            log.debug("link proxy: a connection ended: %r", exc)
        finally:
            # One side gone: the other goes too, as a real connection's would.
            for end in ends:
                self._writers.discard(end)
                self._live.pop(end, None)
                end.close()
