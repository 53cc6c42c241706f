"""The HTTP-pull reference of the distribution series: a file server and pullers.

What teams do without a bus to carry adapters: the trainer's side serves the
adapter's files over HTTP (a bucket behind a proxy), and each node pulls
them once into a folder of its own and checks them before any engine reads
them. Two roles, each a process of its own:

- ``server``: serves ``<root>/<adapter>/<file>`` (aiohttp's file responses,
  ``sendfile`` where the kernel has it) and answers ``served`` with the bytes
  of the files it answered since the last ask;
- ``puller``: answers ``pull`` by downloading an adapter's files for each of
  the nodes it is given, all nodes at once, each into ``<node>/<adapter>/``,
  then computing each copy's adapter digest (``lorabus.adapters.digest``), and
  answers with the digests and how long each node took. Files are written as
  they come, without ``fsync``: a download tool's way.

Run as ``python -m lorabus.testbed.bench.httppull <spec>`` (see ``control.py``).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from lorabus.adapters.digest import adapter_digest
from lorabus.testbed.bench.control import child_main, say, serve_requests

_CHUNK = 1 << 20


async def host(spec: dict[str, Any]) -> None:
    if spec["role"] == "server":
        await _serve(spec["root"])
    elif spec["role"] == "puller":
        await _pull(spec["timeout_s"])
    else:
        raise ValueError(f"unknown role {spec['role']!r}")


def _file_under(root: str, *parts: str) -> tuple[str, int] | None:
    """The path and size of the regular file ``parts`` names under ``root``."""
    root = os.path.realpath(root)
    path = os.path.realpath(os.path.join(root, *parts))
    if os.path.commonpath([root, path]) != root or not os.path.isfile(path):
        return None
    return path, os.path.getsize(path)


async def _serve(root: str) -> None:
    served = 0

    async def get_file(request: web.Request) -> web.StreamResponse:
        nonlocal served
        found = await asyncio.to_thread(
            _file_under, root, request.match_info["adapter"], request.match_info["file"]
        )
        if found is None:
            raise web.HTTPNotFound()
        path, size = found
        served += size
        return web.FileResponse(path)

    app = web.Application()
    app.add_routes([web.get("/{adapter}/{file}", get_file)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        say({"ready": True, "url": f"http://127.0.0.1:{runner.addresses[0][1]}"})

        async def handle(request: dict[str, Any]) -> dict[str, Any]:
            nonlocal served
            if request["op"] != "served":
                raise ValueError(f"unknown request {request['op']!r}")
            figures = {"bytes": served}
            served = 0
            return figures

        await serve_requests(handle)
    finally:
        await runner.cleanup()


async def _pull(timeout_s: float) -> None:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, read_bufsize=_CHUNK
    ) as session:
        say({"ready": True})

        async def handle(request: dict[str, Any]) -> dict[str, Any]:
            if request["op"] != "pull":
                raise ValueError(f"unknown request {request['op']!r}")
            url, adapter, files = request["url"], request["adapter"], request["files"]
            pulled = await asyncio.gather(
                *(_pull_node(session, url, adapter, files, Path(n)) for n in request["nodes"])
            )
            return {"nodes": dict(zip(request["nodes"], pulled, strict=True))}

        await serve_requests(handle)


async def _pull_node(
    session: aiohttp.ClientSession, url: str, adapter: str, files: list[str], node: Path
) -> dict[str, Any]:
    """One node's copy of ``adapter``: downloaded, then hashed."""
    started = time.monotonic()
    target = node / adapter
    target.mkdir(parents=True)
    for name in files:
        async with session.get(f"{url}/{adapter}/{name}") as response:
            response.raise_for_status()
            with (target / name).open("wb") as file:
                async for chunk in response.content.iter_chunked(_CHUNK):
                    # In a thread, as the agents' fetch writes: a write can block.
                    await asyncio.to_thread(file.write, chunk)
    digest = await asyncio.to_thread(adapter_digest, target)
    return {"digest": digest, "seconds": time.monotonic() - started}


if __name__ == "__main__":
    child_main(host)
