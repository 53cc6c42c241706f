"""The child's side of a bench process: a JSON spec in, JSON lines out.

A bench child (agent host, simulated fleet, direct-HTTP baseline) gets its
spec as one JSON argument, says ``{"ready": ...}`` on stdout once it is up,
then answers one JSON request per stdin line with one JSON line, until a
``stop`` request, the end of stdin, SIGTERM or SIGINT. Whatever ends it, its
``finally`` blocks run (agents resume their engines, servers close). Logs go
to stderr, which the parent sends to a file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

_LINE_LIMIT = 1 << 24


def say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def serve_requests(handle: Handler) -> None:
    """Answer requests from stdin until ``stop`` or the end of stdin."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=_LINE_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line.strip():
            if not line:
                return
            continue
        request = json.loads(line)
        if request.get("op") == "stop":
            return
        try:
            say(await handle(request))
        except Exception as exc:
            logging.getLogger(__name__).exception("request %s failed", request.get("op"))
            say({"error": f"{type(exc).__name__}: {exc}"})


def child_main(
    main: Callable[[dict[str, Any]], Awaitable[None]],
    *,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> None:
    """Run ``main(spec)`` with the spec in the JSON file ``argv[1]`` (a host's
    identities outgrow one command-line argument); SIGTERM/SIGINT cancel it.
    ``loop_factory``: the event loop (None: asyncio's)."""
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    spec = json.loads(Path(sys.argv[1]).read_text())

    async def guarded() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await main(spec)
        except asyncio.CancelledError:
            logging.getLogger(__name__).info("stopped by signal")

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(guarded())
