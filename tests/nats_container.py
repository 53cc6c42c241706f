"""A NATS server in a container of lorabus's own image, started through testcontainers.

The NATS fixture falls back to this when the ``nats-server`` binary is missing,
and the ``containers`` tier runs it directly so that the fallback is exercised,
not only written. No NATS image can be pulled where there is no registry, but
the project's image carries nats-server (the ``sim`` extra), so it serves.

testcontainers speaks the Docker API; where there is no Docker daemon, podman's
Docker-compatible socket answers it (``scripts/setup-containers`` starts it).
Its configuration is read from the environment when testcontainers is first
imported, so the defaults below are set before that import.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

#: The image compose.yaml builds (and tags) unless ``LORABUS_IMAGE`` says otherwise.
IMAGE = os.environ.get("LORABUS_IMAGE", "localhost/lorabus:latest")
#: Where podman's Docker-compatible service listens when run as root.
PODMAN_SOCKET = Path("/run/podman/podman.sock")
START_DEADLINE_S = 30.0


def docker_environment() -> dict[str, str]:
    """What testcontainers needs to reach podman, when no Docker host is configured.

    Ryuk (the reaper container) would have to be pulled, so it is off: every
    container is removed by whoever started it. ``docker_host`` connection mode:
    testcontainers otherwise guesses it runs inside a container (this machine
    may carry a ``/.dockerenv``) and looks for a gateway that is not there."""
    if os.environ.get("DOCKER_HOST") or not PODMAN_SOCKET.is_socket():
        return {}
    return {
        "DOCKER_HOST": f"unix://{PODMAN_SOCKET}",
        "TESTCONTAINERS_RYUK_DISABLED": "true",
        "TESTCONTAINERS_CONNECTION_MODE": "docker_host",
    }


def wait_nats_answers(host: str, port: int, deadline_s: float) -> None:
    """Return once a NATS server at host:port sends its INFO line; fail after the deadline.

    The published port accepts connections a moment before the server inside
    does, so a connection that closes at once is retried."""
    give_up = time.monotonic() + deadline_s
    last: Exception | None = None
    while time.monotonic() < give_up:
        try:
            with socket.create_connection((host, port), timeout=2) as conn:
                if conn.recv(4).startswith(b"INFO"):
                    return
        except OSError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"no NATS answered at {host}:{port} within {deadline_s:.0f}s ({last!r})")


@contextlib.contextmanager
def nats_in_container(image: str = IMAGE) -> Iterator[str]:
    """Start nats-server with JetStream in a container of ``image`` on a free
    loopback port; yield its URL; remove the container (and its volumes) after."""
    for key, value in docker_environment().items():
        os.environ.setdefault(key, value)
    from testcontainers.core.container import DockerContainer

    container = DockerContainer(image).with_command(
        ["nats-server", "--jetstream", "--store_dir=/data", "--port=4222"]
    )
    # Loopback only, on a port the engine picks: a bare "4222" leaves podman's
    # answer without a host, and a fixed port may be taken.
    container.ports["4222/tcp"] = ("127.0.0.1",)  # type: ignore[assignment]
    with container:
        port = int(container.get_exposed_port(4222))
        wait_nats_answers("127.0.0.1", port, START_DEADLINE_S)
        yield f"nats://127.0.0.1:{port}"
