"""The chaos run's partition: a link proxy that stops forwarding, closing nothing."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from lorabus.testbed.chaos.proxy import LinkProxy


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
    writer.close()


@pytest.mark.parametrize("cut", ["both", "to_bus", "from_bus"])
async def test_a_cut_link_holds_bytes_without_closing_and_delivers_them_in_order_when_healed(
    cut: str,
) -> None:
    upstream = await asyncio.start_server(_echo, "127.0.0.1", 0)
    proxy = LinkProxy(upstream.sockets[0].getsockname()[1])
    await proxy.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    try:
        writer.write(b"a")
        assert await asyncio.wait_for(reader.readexactly(1), 5) == b"a"

        proxy.cut(to_bus=cut in ("both", "to_bus"), from_bus=cut in ("both", "from_bus"))
        writer.write(b"bc")
        await writer.drain()
        with pytest.raises(TimeoutError):  # held, one way or the other
            await asyncio.wait_for(reader.readexactly(1), 0.3)
        assert not reader.at_eof() and proxy.is_cut

        proxy.heal()
        assert await asyncio.wait_for(reader.readexactly(2), 5) == b"bc"
        assert not proxy.is_cut
    finally:
        writer.close()
        await proxy.aclose()
        upstream.close()
        await upstream.wait_closed()


async def test_a_link_to_a_server_that_is_down_is_closed_at_once() -> None:
    """Like a connection refused: the client reconnects, as to a stopped server."""
    unused = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = unused.sockets[0].getsockname()[1]
    unused.close()
    await unused.wait_closed()
    proxy = LinkProxy(port)
    await proxy.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await asyncio.wait_for(reader.read(1), 5) == b""
        writer.close()
    finally:
        await proxy.aclose()
