"""The embedded stack: NATS, a simulated fleet, its agents and a coordinator.

``lorabus up`` runs it around a demo trainer, and tests use it when they need a
whole fleet in one process. Each service gets its own NATS connection, as it
would in its own process. Everything started here is stopped on exit, in
reverse order, also when the body raises or is cancelled.

``secure``: the private nats-server runs with the configuration of ``lorabus
auth init`` (nkeys, per-role permissions, mutual TLS), the operator sets the
fleet up, and every part connects as its own identity (the coordinator, each
agent, the orchestrator's client); :meth:`EmbeddedStack.bus_as` gives any
identity's connection settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient

from lorabus.agents import Agent, AgentConfig, driver_for
from lorabus.bus.connect import Bus, close
from lorabus.bus.options import BusOptions
from lorabus.client import UpdateClient
from lorabus.coordinator import Coordinator, CoordinatorConfig
from lorabus.coordinator.config import StorageConfig
from lorabus.coordinator.streams import provision
from lorabus.errors import StartFailed
from lorabus.schemas import Subjects
from lorabus.schemas.tenants import Tenant, encode_tenants
from lorabus.security.auth_init import (
    SIGNING_SEED_FILE,
    TENANTS_FILE,
    FleetAuth,
    write_fleet_auth,
)
from lorabus.security.roles import Role
from lorabus.simfleet import SimFleet
from lorabus.simfleet.identity import numbered_worker_ids
from lorabus.testbed.natsserver import NatsServer

log = logging.getLogger(__name__)


class EmbeddedStack:
    """NATS (private unless ``nats_url`` is given), a simulated fleet of one worker
    per world size, its agents and a coordinator. ``coordinator`` settings go to
    :class:`CoordinatorConfig` as they are: its defaults are the stack's."""

    def __init__(
        self,
        world_sizes: Sequence[int],
        *,
        fleet: str,
        nats_url: str | None = None,
        heartbeat_s: float = 0.5,
        secure: bool = False,
        auth_method: str = "nkey",
        adapter_roots: Sequence[str] = (),
        cache_root: str | None = None,
        tenants: Mapping[str, Tenant] | None = None,
        labels: Sequence[Sequence[str]] = (),
        idle_nodes: Mapping[str, Sequence[str]] | None = None,
        **coordinator: Any,
    ) -> None:
        if secure and nats_url is not None:
            raise ValueError("a secure stack runs its own nats-server")
        self.world_sizes = list(world_sizes)
        self.fleet_name = fleet
        self._nats_url = nats_url
        self._heartbeat_s = heartbeat_s
        self.secure = secure
        self.auth_method = auth_method
        """How a secure stack's identities prove themselves (``lorabus auth init --method``)."""
        self.adapter_roots = list(adapter_roots)
        """Where the agents (and the coordinator) accept adapters from (empty: anywhere)."""
        self.cache_root = cache_root
        """With it, each agent keeps adapters from the object store in a folder of
        its own under it, as agents on separate nodes would (None: a temporary one)."""
        self.labels = [list(specs) for specs in labels]
        """Each worker's agent's ``--label KEY=VALUE``s, in worker order (none past the end)."""
        self.idle_nodes = dict(idle_nodes or {})
        """A secure stack's node identities (``auth init --node``) that no
        process runs: an identity to test permissions as."""
        self.tenants = dict(tenants or {})
        """The fleet's tenants (a secure stack gives each an identity: :meth:`client_as`)."""
        self.auth: FleetAuth | None = None
        self._coordinator_settings = {"expected_world_size": sum(self.world_sizes), **coordinator}
        self.server: NatsServer | None = None
        self.sim: SimFleet | None = None
        self.coordinator: Coordinator | None = None
        self.client: UpdateClient | None = None
        self._exit = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []
        self._connections: list[NatsClient] = []

    @property
    def nats_url(self) -> str:
        if self._nats_url is not None:
            return self._nats_url
        assert self.server is not None, "the stack is started"
        return self.server.url.replace("nats://", "tls://") if self.secure else self.server.url

    def bus_as(self, role: Role, worker_id: str | None = None) -> Bus:
        """Where the stack's NATS is, and how to connect to it as ``role``
        (an unauthenticated connection when the stack is not secure)."""
        if self.auth is None:
            return Bus(self.nats_url)
        folder = self.auth.identity(role, worker_id).folder
        return Bus(self.nats_url, BusOptions.of_identity(folder))

    async def __aenter__(self) -> EmbeddedStack:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _start(self) -> None:
        worker_ids = numbered_worker_ids(len(self.world_sizes))
        if self.secure:
            folder = Path(self._exit.enter_context(tempfile.TemporaryDirectory()))
            self.auth = write_fleet_auth(
                folder / "auth",
                Subjects(fleet=self.fleet_name),
                worker_ids,
                tls=True,
                method=self.auth_method,
                tenants=self.tenants,
                nodes=self.idle_nodes,
            )
        if self._nats_url is None:
            include = self.auth.server_conf if self.auth is not None else None
            self.server = await self._exit.enter_async_context(NatsServer(include=include))
        if self.auth is not None:
            await self._provision()
        self.sim = SimFleet(worker_ids, self.world_sizes)
        await self._exit.enter_async_context(self.sim)
        cache_root = self.cache_root or self._exit.enter_context(
            tempfile.TemporaryDirectory(prefix="lorabus-caches-")
        )
        settings: dict[str, Any] = {"adapter_roots": self.adapter_roots}
        if self.auth is not None:
            folder = self.auth.identity(Role.COORDINATOR).folder
            settings["signing_key_file"] = str(folder / SIGNING_SEED_FILE)
            if self.tenants:
                settings["tenants_file"] = str(folder / TENANTS_FILE)
        elif self.tenants:
            folder = Path(self._exit.enter_context(tempfile.TemporaryDirectory()))
            (folder / TENANTS_FILE).write_bytes(encode_tenants(self.tenants))
            settings["tenants_file"] = str(folder / TENANTS_FILE)
        config = CoordinatorConfig(
            fleet=self.fleet_name,
            frontend_url=self.sim.url,
            **{**settings, **self._coordinator_settings},
        )
        self.coordinator = Coordinator(config)
        await self._serve("coordinator", self.coordinator.run, self.bus_as(Role.COORDINATOR))
        for index, worker in enumerate(self.sim.workers.values()):
            agent_config = AgentConfig(
                fleet=self.fleet_name,
                worker_id=worker.worker_id,
                system_url=self.sim.system_url(worker.worker_id),
                frontend_url=self.sim.url,
                world_size=worker.world_size,
                heartbeat_s=self._heartbeat_s,
                coordinator_keys=[self.auth.signing_key] if self.auth is not None else [],
                adapter_roots=self.adapter_roots,
                cache_dir=str(Path(cache_root) / worker.worker_id),
                labels=self.labels[index] if index < len(self.labels) else [],
            )
            driver = driver_for(agent_config)
            self._exit.push_async_callback(driver.aclose)
            agent = Agent.from_config(agent_config, driver)
            await agent.executor.refresh()
            identity = self.bus_as(Role.AGENT, worker.worker_id)
            await self._serve(f"agent-{worker.worker_id}", agent.run, identity)
        client_nc = await self._connect("client", self.bus_as(Role.ORCHESTRATOR))
        self.client = UpdateClient(client_nc, self.fleet_name)

    async def client_as(self, tenant: str) -> UpdateClient:
        """A client of tenant ``tenant``, on a connection of its own (as its
        identity in a secure stack), closed with the stack."""
        bus = (
            self.bus_as(Role.TENANT, tenant)
            if self.auth is not None
            else self.bus_as(Role.ORCHESTRATOR)
        )
        nc = await self._connect(f"tenant-{tenant}", bus)
        return UpdateClient(nc, self.fleet_name, tenant=tenant)

    async def _provision(self) -> None:
        nc = await self.bus_as(Role.OPERATOR).connect(f"lorabus-operator-{self.fleet_name}")
        try:
            storage = {
                name: value
                for name, value in self._coordinator_settings.items()
                if name in StorageConfig.__struct_fields__
            }
            if self.tenants:
                assert self.auth is not None
                folder = self.auth.identity(Role.OPERATOR).folder
                storage["tenants_file"] = str(folder / TENANTS_FILE)
            await provision(nc, StorageConfig(fleet=self.fleet_name, **storage))
        finally:
            await close(nc)

    async def _connect(self, name: str, bus: Bus) -> NatsClient:
        nc = await bus.connect(f"lorabus-{name}")
        self._connections.append(nc)
        return nc

    async def _serve(self, name: str, run: object, bus: Bus) -> None:
        nc = await self._connect(name, bus)
        ready = asyncio.Event()
        task = asyncio.create_task(run(nc, ready), name=name)  # type: ignore[operator]
        self._tasks.append(task)
        waiter = asyncio.ensure_future(ready.wait())
        done, _ = await asyncio.wait(
            {task, waiter}, timeout=10, return_when=asyncio.FIRST_COMPLETED
        )
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        if task in done:
            task.result()  # raises what killed it
        if not ready.is_set():
            raise StartFailed(f"{name} did not become ready within 10s")

    async def __aexit__(self, *exc_info: object) -> None:
        # The coordinator stops first, while the agents still listen: an update
        # it interrupts ends with a resume that every agent can still act on.
        coordinator, agents = self._tasks[:1], self._tasks[1:]
        for group in (coordinator, agents):
            for task in group:
                task.cancel()
            results = await asyncio.gather(*group, return_exceptions=True)
            for task, result in zip(group, results, strict=True):
                if isinstance(result, Exception):
                    log.error("%s had died: %r", task.get_name(), result)
        self._tasks.clear()
        for nc in reversed(self._connections):
            await close(nc)
        self._connections.clear()
        await self._exit.aclose()
