"""The processes every series at one fleet size stands on.

A :class:`BenchFleet` is one fleet size's share of a run: its nats-server
(set by whoever starts it), the simulated Dynamo fleet, the agent host
processes and the readiness check of a fleet under a coordinator. The
update modes (``runner``) and the distribution series (``distribution``)
each measure on one of their own; both stop what they started through its
:class:`~lorabus.testbed.bench.children.Children`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient

from lorabus.bus.connect import connect
from lorabus.bus.options import BusOptions, identity_env
from lorabus.client import UpdateClient
from lorabus.errors import NoCoordinator
from lorabus.security.auth_init import FleetAuth
from lorabus.security.roles import Role
from lorabus.simfleet.identity import numbered_worker_ids
from lorabus.testbed.bench.children import Child, Children
from lorabus.testbed.bench.config import NODE_WORKERS, BenchConfig
from lorabus.testbed.bench.procinfo import ForeignLoad, cpu_seconds
from lorabus.testbed.natsserver import NatsServer


class BenchFailed(Exception):
    """Raised when a mode cannot be measured (a process died, a fleet never got ready)."""


class BenchFleet:
    """N simulated workers and what serves them, for one case of a run."""

    def __init__(
        self,
        config: BenchConfig,
        case: str,
        n: int,
        latency: float,
        jitter: float,
        log_dir: Path,
    ) -> None:
        self.config = config
        self.case = case
        self.n = n
        self.latency = latency
        self.jitter = jitter
        self.log_dir = log_dir
        self.workers = dict(zip(numbered_worker_ids(n), config.world_sizes_for(n), strict=True))
        self.world_size = sum(self.workers.values())
        self.heartbeat_s = config.heartbeat_for(n)
        self.host_count = min(config.agent_procs, n)
        self.children = Children(self.log_dir)
        self.nats: NatsServer | None = None
        self.auth: FleetAuth | None = None
        """The identities of the mode being measured, in a secure run."""
        self.sims: list[Child] = []
        """The simulated fleet's processes (``config.sim_workers`` workers each)."""
        self.sim_frontends: list[str] = []
        """The URL of each of :attr:`sims`."""
        self.sim_urls: dict[str, str] = {}
        """Each worker's simulated fleet process: its frontend's URL."""

    @property
    def nats_url(self) -> str:
        assert self.nats is not None
        return self.nats.url.replace("nats://", "tls://") if self.auth else self.nats.url

    def identity_env(self, role: Role, worker_id: str | None = None) -> dict[str, str]:
        """The variables that make a process connect as ``role`` (none outside a
        secure run): paths and an inbox prefix, no secret."""
        if self.auth is None:
            return {}
        folder = self.auth.identity(role, worker_id).folder
        return identity_env(folder)

    async def connect(self, role: Role, *, name: str) -> NatsClient:
        options = BusOptions.from_env(self.identity_env(role))
        return await connect(self.nats_url, name=name, options=options)

    @property
    def sim_url(self) -> str:
        """The frontend of the first simulated fleet process: the one the
        coordinator and the baseline check (it lists what its workers serve)."""
        return self.sim_frontends[0] if self.sim_frontends else ""

    def system_url(self, worker_id: str) -> str:
        return f"{self.sim_urls[worker_id]}/workers/{worker_id}"

    async def start_sim(self) -> None:
        """The simulated fleet, ``config.sim_workers`` workers a process."""
        ids, size = list(self.workers), self.config.sim_workers
        for index, start in enumerate(range(0, len(ids), size)):
            chunk = ids[start : start + size]
            spec = {
                "workers": {wid: self.workers[wid] for wid in chunk},
                "load_latency_s": self.latency,
                "load_jitter_s": self.jitter,
                "seed": self.n + index,
            }
            child, ready = await self.children.bench_child(f"sim{index or ''}", "simhost", spec)
            self.sims.append(child)
            self.sim_frontends.append(ready["url"])
            self.sim_urls.update(dict.fromkeys(chunk, ready["url"]))

    async def draw_loads(self) -> float:
        """Each simulated worker's next load time; the slowest."""
        answers = await asyncio.gather(*(sim.ask("jitter") for sim in self.sims))
        return max((a["slowest_load_s"] for a in answers), default=0.0)

    def sim_cpu_s(self) -> float:
        return sum(cpu_seconds(sim.pid) for sim in self.sims)

    def ready_timeout_s(self) -> float:
        return 60.0 + self.n * 0.1

    async def start_hosts(
        self,
        role: str,
        fleet: str,
        workers: dict[str, int],
        layout: str,
        engine: str = "null",
        *,
        cache_dirs: dict[str, str] | None = None,
        max_adapters: int = 0,
    ) -> list[Child]:
        """Agent host processes for ``workers`` (``cache_dirs``: each worker's
        adapter cache, for adapters from the fleet's object store;
        ``max_adapters``: each agent's ``--max-adapters``)."""
        assert self.nats is not None
        ids = list(workers)
        nodes = node_groups(ids) if layout == "node" else {}
        count = min(self.host_count, len(nodes) if nodes else len(ids))
        if nodes:  # each node's workers on one host, the nodes dealt out
            names = list(nodes)
            chunks = [[w for name in names[i::count] for w in nodes[name]] for i in range(count)]
        else:
            chunks = [ids[i::count] for i in range(count)]
        specs: list[dict[str, Any]] = [
            {
                "role": role,
                "nats_url": self.nats_url,
                "fleet": fleet,
                "identities": (
                    {n: self.identity_env(Role.NODE, n) for n in names[i::count]}
                    if nodes
                    else {wid: self.identity_env(Role.AGENT, wid) for wid in chunk}
                ),
                "nodes": {n: nodes[n] for n in names[i::count]} if nodes else {},
                "workers": {wid: workers[wid] for wid in chunk},
                "engine": engine,
                "sim_urls": {wid: self.sim_urls[wid] for wid in chunk if wid in self.sim_urls},
                "shared_connection": layout == "shared",
                "heartbeat_s": self.heartbeat_s,
                "ready_timeout_s": self.ready_timeout_s(),
                "load_latency_s": self.latency,
                "load_jitter_s": self.jitter,
                "seed": self.n * 100 + i,
                "cache_dirs": {wid: cache_dirs[wid] for wid in chunk} if cache_dirs else {},
                "max_adapters": max_adapters,
            }
            for i, chunk in enumerate(chunks)
        ]
        started = await asyncio.gather(
            *(
                self.children.bench_child(
                    f"{fleet}-host{i}",
                    "agenthost",
                    spec,
                    ready_timeout_s=self.ready_timeout_s() + 30,
                )
                for i, spec in enumerate(specs)
            ),
            return_exceptions=True,
        )
        hosts = [s[0] for s in started if not isinstance(s, BaseException)]
        failure = next((s for s in started if isinstance(s, BaseException)), None)
        if failure is not None:
            await self.children.stop_all(hosts)
            raise failure
        return hosts

    def foreign_load(self, children: Sequence[Child]) -> ForeignLoad:
        """Watches the machine for load that is not this run's."""
        pids = [child.pid for child in children]
        for server in (self.nats.process if self.nats else None, *self.sims):
            if server is not None:
                pids.append(server.pid)
        return ForeignLoad(pids)

    async def wait_fleet_ready(self, client: UpdateClient, processes: list[Child]) -> None:
        """Until the coordinator leads and every agent is live and ready."""
        deadline = time.monotonic() + self.ready_timeout_s()
        seen = "no coordinator answered"
        while time.monotonic() < deadline:
            dead = [p for p in processes if not p.running]
            if dead:
                raise BenchFailed(f"{dead[0].name} exited; its log:\n{dead[0].log_tail()}")
            try:
                status = await client.status(timeout_s=5)
            except NoCoordinator:
                await asyncio.sleep(0.25)
                continue
            ready = sum(m.world_size for m in status.members if m.ready)
            if ready == self.world_size:
                return
            seen = f"{ready} of {self.world_size} world size ready"
            await asyncio.sleep(0.25)
        raise BenchFailed(f"the fleet was not ready in time: {seen}")


def node_groups(worker_ids: Sequence[str]) -> dict[str, list[str]]:
    """The ``node`` layout's nodes: each :data:`NODE_WORKERS` workers in a row."""
    return {
        f"node{k // NODE_WORKERS:03d}": list(worker_ids[k : k + NODE_WORKERS])
        for k in range(0, len(worker_ids), NODE_WORKERS)
    }


def cpu_of(children: Sequence[Child]) -> float:
    """CPU seconds the processes of ``children`` have used so far, together."""
    return sum(cpu_seconds(child.pid) for child in children)


def pause_window(engines: Sequence[dict[str, Any]]) -> float | None:
    """First engine pausing to last engine resumed, over every agent host."""
    firsts = [e["first_pause"] for e in engines if e["first_pause"] is not None]
    lasts = [e["last_resume"] for e in engines if e["last_resume"] is not None]
    if not firsts or not lasts:
        return None
    return max(lasts) - min(firsts)
