"""Serving a part's Prometheus registry over HTTP, for ``--metrics-port``.

The parts only record into registries of their own; whether and where they
are served is the deployment's choice, so it lives with the CLI.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server


@contextlib.contextmanager
def serving(registry: CollectorRegistry, port: int | None, host: str = "0.0.0.0") -> Iterator[None]:
    """Serve ``registry`` at ``http://host:port/metrics`` while inside; nothing if no port."""
    if port is None:
        yield
        return
    server, thread = start_http_server(port, addr=host, registry=registry)
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
