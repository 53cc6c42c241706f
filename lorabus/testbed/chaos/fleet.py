"""The fleet a chaos run breaks: nats-server, simulated engines, agents, coordinators.

Agents and coordinators are ``lorabus agent`` / ``lorabus coordinator`` OS
processes, so a kill is a real kill (each agent with an adapter cache of its
own, as on a node of its own); the simulated Dynamo fleet is served from
this process (its engines are watched exactly and faulted directly); the
nats-server is a :class:`NatsServer` process that can be stopped and started
again on the same port with the same JetStream store.

In cluster mode there are three nodes, each route between two of them through
a :class:`LinkProxy`, so one node can be cut off from the others while its
clients stay connected to it. Each process has a home node (round robin) and
falls over to another when its node is down or cut off. Node 0 carries the
run's own connection (its observers and requests) and is never faulted: the
run must see every event the fleet sends. Every fault applied here
is written to the timeline as a window, so the invariants know what excused
what. A process that exits without a fault is recorded as a crash and
restarted, as a supervisor would. Everything started is stopped on exit.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import msgspec
import nats.errors

from lorabus.agents.config import AgentConfig
from lorabus.client import UpdateClient
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.errors import NoCoordinator, StartFailed
from lorabus.service_flags import agent_args, coordinator_args
from lorabus.simfleet import SimFleet
from lorabus.testbed.chaos.config import FleetSettings
from lorabus.testbed.chaos.procs import Child, ProcessGroup
from lorabus.testbed.chaos.proxy import LinkProxy
from lorabus.testbed.chaos.timeline import (
    AGENT_CUT_OFF,
    AGENT_DOWN,
    AGENT_PARTITIONED,
    AGENT_STOPPED,
    COORDINATOR_DOWN,
    COORDINATOR_PARTITIONED,
    COORDINATOR_STOPPED,
    ENGINE_ERROR,
    ENGINE_HANG,
    ENGINE_LATENCY,
    ENGINE_RESTART,
    NATS_DOWN,
    NATS_NODE_PARTITIONED,
    Timeline,
    Window,
    now,
)
from lorabus.testbed.natsserver import NatsServer, free_port

log = logging.getLogger(__name__)

_NATS_START_ATTEMPTS = 5
_MAX_RESTARTS = 3
"""Restarts of one crashed process; past them a crash loop is left down."""
_NO_ROUTE_GOSSIP = "127.0.0.1:1"
"""What a cluster-mode node advertises to the others for routes: nothing
reachable, so the routes it gossips are never dialled, and every route goes
through the proxies that a node partition cuts."""


class ChaosFleet:
    def __init__(
        self,
        settings: FleetSettings,
        run_dir: Path,
        timeline: Timeline,
        out: Callable[[str], None] = print,
    ) -> None:
        self.settings = settings
        self.out = out
        self.run_dir = run_dir
        self.timeline = timeline
        self.sim = SimFleet.of_size(len(settings.world_sizes), settings.world_sizes)
        self.processes = ProcessGroup(run_dir / "logs")
        self.nodes = self._first_nodes(settings.nats_nodes)
        self._servers = list(self.nodes)
        """Every nats-server started, all stopped on exit (stopping twice is harmless)."""
        self._routes: dict[tuple[int, int], LinkProxy] = {}
        """Cluster mode: by (node that dials, node dialled), the proxy of that route."""
        self._cut_off: set[int] = set()
        """Nodes cut off from the others now."""
        self._restarted_nodes = 0
        self.agents: dict[str, Child] = {}
        self.coordinators: dict[str, Child] = {}
        self._holders = 0
        self._open: dict[tuple[str, str], Window] = {}
        self._supervisors: set[asyncio.Task[None]] = set()
        self._restarts: dict[str, int] = {}
        self._closing = False
        self.links: dict[str, LinkProxy] = {}
        """Each process's link to nats-server, by process name (kept across
        its restarts): a partition cuts one."""
        size = settings.workers_per_node
        ids = list(self.sim.workers)
        self.node_of: dict[str, str] = (
            {w: f"node{i // size}" for i, w in enumerate(ids)} if size > 1 else {}
        )
        """With node agents: each worker's node."""

    def _first_nodes(self, count: int) -> list[NatsServer]:
        if count == 1:
            return [NatsServer(port=free_port(), store_dir=str(self.run_dir / "nats"))]
        cluster_ports = [free_port() for _ in range(count)]
        return [
            NatsServer(
                port=free_port(),
                store_dir=str(self.run_dir / f"nats-n{i}"),
                name=f"n{i}",
                cluster_port=cluster_ports[i],
                # Clients are not told the nodes' own addresses either: a
                # process that reconnected straight to a node would be past
                # the link proxy that its partitions cut.
                options=["--cluster_advertise", _NO_ROUTE_GOSSIP, "--no_advertise"],
            )
            for i in range(count)
        ]

    @property
    def nats(self) -> NatsServer:
        """The node the run observes from (the only one, outside cluster mode)."""
        return self.nodes[0]

    @property
    def nats_url(self) -> str:
        return self.nats.url

    @property
    def clustered(self) -> bool:
        return len(self.nodes) > 1

    @property
    def worker_ids(self) -> list[str]:
        return sorted(self.sim.workers)

    @property
    def expected_world_size(self) -> int:
        return sum(w.world_size for w in self.sim.workers.values())

    async def __aenter__(self) -> ChaosFleet:
        try:
            await self._start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _start(self) -> None:
        for i, node in enumerate(self.nodes):
            for j, other in enumerate(self.nodes):
                if i != j:
                    assert other.cluster_port is not None
                    route = self._routes[(i, j)] = LinkProxy(other.cluster_port)
                    await route.start()
                    node.routes.append(route.port)
        await asyncio.gather(*(node.start() for node in self.nodes))
        await self.sim.start()
        self.timeline.world_sizes = {w.worker_id: w.world_size for w in self.sim.workers.values()}

    async def start_services(self) -> None:
        """The coordinators and one agent per worker (after the observers listen)."""
        for _ in range(self.settings.coordinators):
            await self.start_coordinator()
        started: set[str] = set()
        for worker_id in self.worker_ids:
            if self.node_of.get(worker_id, worker_id) not in started:
                await self.start_agent(worker_id)
                started.add(self.node_of.get(worker_id, worker_id))

    async def aclose(self) -> None:
        self._closing = True
        # Coordinators first, so an update they interrupt ends with a resume
        # that the agents are still there to carry out.
        try:
            await self.processes.stop_all(self.coordinators.values())
        finally:
            await self.processes.aclose()
        for task in self._supervisors:
            task.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)
        for link in [*self.links.values(), *self._routes.values()]:
            await link.aclose()
        for server in self._servers:
            await asyncio.to_thread(server.stop)
        await self.sim.stop()

    async def wait_ready(self, client: UpdateClient, deadline_s: float = 30.0) -> bool:
        """Poll until a leader answers and every worker is live and ready; False at the deadline."""
        want = set(self.worker_ids)
        deadline = now() + deadline_s
        while now() < deadline:
            try:
                status = await client.status(timeout_s=1.0)
            except (NoCoordinator, nats.errors.Error) as exc:
                log.debug("fleet not ready yet: %s", exc)
            else:
                if {m.worker_id for m in status.members if m.ready} == want:
                    return True
            await asyncio.sleep(0.1)
        return False

    # -- crashes ------------------------------------------------------------------

    def _supervise(self, child: Child, worker_id: str = "") -> None:
        """Watch ``child``: an exit that no fault caused is a crash, recorded and,
        as a supervisor would, answered with a restart (a few times at most)."""
        task = asyncio.create_task(self._on_exit(child, worker_id), name=f"watch-{child.name}")
        self._supervisors.add(task)
        task.add_done_callback(self._supervisors.discard)

    async def _on_exit(self, child: Child, worker_id: str) -> None:
        code = await child.process.wait()
        if child.ended_on_purpose or self._closing:
            return
        self.timeline.crashes.append(
            f"{child.name} (pid {child.pid}) exited {code}; log {child.log_path}:\n"
            f"{child.log_tail()}"
        )
        restarts = self._restarts[child.name] = self._restarts.get(child.name, 0) + 1
        if restarts > _MAX_RESTARTS:
            self.out(f"crash  {child.name} exited {code}; not restarted again")
            return
        self.out(f"crash  {child.name} exited {code}; restarting it")
        if worker_id:
            for mate in self.mates(worker_id):
                self._begin(AGENT_DOWN, mate)
            await self.restart_agent(worker_id)
        else:
            holder = next((h for h, c in self.coordinators.items() if c is child), None)
            if holder is not None:
                del self.coordinators[holder]
            await self.start_coordinator()

    # -- links ------------------------------------------------------------------

    async def _link(self, process: str) -> LinkProxy:
        link = self.links.get(process)
        if link is None:
            home = len(self.links) % len(self.nodes)
            link = self.links[process] = LinkProxy(lambda: self._client_ports(home))
            await link.start()
        return link

    def _client_ports(self, home: int) -> list[int]:
        """Where a process homed on node ``home`` connects: there first, then
        the others; a node cut off from the others only when none is left."""
        order = [home, *(i for i in range(len(self.nodes)) if i != home)]
        order.sort(key=lambda i: i in self._cut_off)
        return [self.nodes[i].port for i in order]

    def partition(
        self, process: str, kind: str, subject: str, *, to_bus: bool, from_bus: bool
    ) -> None:
        """Cut ``process``'s link (a window of ``kind`` on ``subject`` in the timeline)."""
        self.links[process].cut(to_bus=to_bus, from_bus=from_bus)
        self._begin(kind, subject)

    def heal_partition(self, process: str, kind: str, subject: str) -> None:
        self.links[process].heal()
        self._end(kind, subject)

    # -- agents ------------------------------------------------------------------

    def mates(self, worker_id: str) -> list[str]:
        """The workers one agent process serves with ``worker_id``: its node's
        with node agents, else itself alone."""
        node = self.node_of.get(worker_id)
        return [w for w, n in self.node_of.items() if n == node] if node else [worker_id]

    def agent_process(self, worker_id: str) -> str:
        """The name of the agent process that serves ``worker_id``."""
        node = self.node_of.get(worker_id)
        return f"node-{node}" if node else f"agent-{worker_id}"

    async def start_agent(self, worker_id: str) -> Child:
        """The agent process of ``worker_id`` (with node agents, its node's)."""
        s = self.settings
        configs = [
            AgentConfig(
                fleet=s.fleet,
                worker_id=mate,
                system_url=self.sim.system_url(mate),
                frontend_url=self.sim.url,
                world_size=self.sim.workers[mate].world_size,
                heartbeat_s=s.heartbeat_s,
                engine_timeout_s=s.engine_timeout_s,
                # A cache of its own, as on a node of its own (kept across restarts).
                cache_dir=str(self.run_dir / "caches" / mate),
            )
            for mate in self.mates(worker_id)
        ]
        name = self.agent_process(worker_id)
        link = await self._link(name)
        node = self.node_of.get(worker_id)
        if node is None:
            args = agent_args(configs[0], nats_url=link.url)
        else:
            args = node_agent_args(node, configs, self.run_dir / f"{name}.toml", link.url)
        child = await self.processes.start(name, args, log_level=s.log_level)
        for config in configs:
            self.agents[config.worker_id] = child
            self.timeline.agent_started(config.worker_id, child.started_at)
        self._supervise(child, worker_id)
        return child

    async def kill_agent(self, worker_id: str) -> None:
        await self.agents[worker_id].kill()
        for mate in self.mates(worker_id):
            self._begin(AGENT_DOWN, mate)

    async def restart_agent(self, worker_id: str) -> None:
        child = await self.start_agent(worker_id)
        for mate in self.mates(worker_id):
            self._end(AGENT_DOWN, mate, at=child.started_at)

    def stop_agent(self, worker_id: str) -> None:
        self.agents[worker_id].suspend()
        for mate in self.mates(worker_id):
            self._begin(AGENT_STOPPED, mate)

    def continue_agent(self, worker_id: str) -> None:
        self.agents[worker_id].resume()
        for mate in self.mates(worker_id):
            self._end(AGENT_STOPPED, mate)

    def partition_agent(self, worker_id: str, *, to_bus: bool, from_bus: bool) -> None:
        """Cut the link of ``worker_id``'s agent process (its whole node's)."""
        self.links[self.agent_process(worker_id)].cut(to_bus=to_bus, from_bus=from_bus)
        for mate in self.mates(worker_id):
            self._begin(AGENT_PARTITIONED, mate)

    def heal_agent_partition(self, worker_id: str) -> None:
        self.links[self.agent_process(worker_id)].heal()
        for mate in self.mates(worker_id):
            self._end(AGENT_PARTITIONED, mate)

    # -- coordinators ------------------------------------------------------------------

    async def start_coordinator(self) -> Child:
        s = self.settings
        self._holders += 1
        holder = f"c{self._holders}"
        config = CoordinatorConfig(
            fleet=s.fleet,
            frontend_url=self.sim.url,
            expected_world_size=self.expected_world_size,
            holder=holder,
            leader_lease_s=s.leader_lease_s,
            pause_lease_s=s.pause_lease_s,
            phase_timeout_s=s.phase_timeout_s,
            quorum_timeout_s=s.quorum_timeout_s,
            verify_timeout_s=s.verify_timeout_s,
            prepare_timeout_s=s.prepare_timeout_s,
            quorum=s.quorum,
            keep=s.keep,
            orphan_after_s=s.orphan_after_s,
            kv_replicas=len(self.nodes),
        )
        link = await self._link(f"coordinator-{holder}")
        child = await self.processes.start(
            f"coordinator-{holder}",
            coordinator_args(config, nats_url=link.url),
            log_level=s.log_level,
        )
        self.coordinators[holder] = child
        self._supervise(child)
        return child

    def leader(self) -> str | None:
        """The holder of the latest leader_elected event, if its process still runs."""
        if not self.timeline.leaders:
            return None
        holder = self.timeline.leaders[-1][1]
        child = self.coordinators.get(holder)
        return holder if child is not None and child.running else None

    async def kill_coordinator(self, holder: str) -> None:
        await self.coordinators.pop(holder).kill()
        self._begin(COORDINATOR_DOWN, "")

    def stop_coordinator(self, holder: str) -> None:
        self.coordinators[holder].suspend()
        self._begin(COORDINATOR_STOPPED, holder)

    def continue_coordinator(self, holder: str) -> None:
        child = self.coordinators.get(holder)
        if child is not None:
            child.resume()
        self._end(COORDINATOR_STOPPED, holder)

    async def replace_coordinator(self) -> None:
        await self.start_coordinator()
        self._end(COORDINATOR_DOWN, "")

    # -- nats ----------------------------------------------------------------------

    def faultable_node(self) -> int:
        """The node a node fault takes next: the only one, or in turn each but
        the node the run observes from."""
        if not self.clustered:
            return 0
        self._restarted_nodes += 1
        return 1 + (self._restarted_nodes - 1) % (len(self.nodes) - 1)

    def _node_subject(self, node: int) -> str:
        return self.nodes[node].name if self.clustered else ""

    async def stop_nats(self, node: int = 0) -> None:
        subject = self._node_subject(node)
        if (NATS_DOWN, subject) in self._open:
            return
        await asyncio.to_thread(self.nodes[node].stop)
        self._begin(NATS_DOWN, subject)

    async def start_nats(self, node: int = 0) -> None:
        """A new nats-server on the same port, routes and JetStream store as the last one."""
        for attempt in range(1, _NATS_START_ATTEMPTS + 1):
            server = _same_again(self.nodes[node])
            self._servers.append(server)
            try:
                await server.start()
            except StartFailed as exc:  # e.g. the port is not free again yet
                if attempt == _NATS_START_ATTEMPTS:
                    raise
                log.warning("nats-server did not start (%s); trying again", exc)
                await asyncio.sleep(0.2 * attempt)
            else:
                self.nodes[node] = server
                break
        self._end(NATS_DOWN, self._node_subject(node))

    @property
    def nats_down(self) -> bool:
        return any(kind == NATS_DOWN for kind, _ in self._open)

    def cut_off_node(self, node: int) -> None:
        """Stop every route to and from ``node``, both ways, closing nothing;
        each agent connected to it then is cut off with it."""
        for (i, j), route in self._routes.items():
            if node in (i, j):
                route.cut()
        self._cut_off.add(node)
        self._begin(NATS_NODE_PARTITIONED, self.nodes[node].name)
        port = self.nodes[node].port
        for worker_id in self.worker_ids:
            link = self.links.get(self.agent_process(worker_id))
            if link is not None and link.reaches(port):
                self._begin(AGENT_CUT_OFF, worker_id)

    def reconnect_node(self, node: int) -> None:
        self._cut_off.discard(node)
        for (i, j), route in self._routes.items():
            if node in (i, j) and not ({i, j} & self._cut_off):
                route.heal()
        self._end(NATS_NODE_PARTITIONED, self.nodes[node].name)
        if not self._cut_off:
            for worker_id in self.worker_ids:
                self._end(AGENT_CUT_OFF, worker_id)

    # -- engines -------------------------------------------------------------------

    def slow_engine(self, worker_id: str, latency_s: dict[str, float]) -> None:
        self.sim.workers[worker_id].set_faults(latency_s=latency_s)
        self._begin(ENGINE_LATENCY, worker_id, latency_s)

    def unslow_engine(self, worker_id: str) -> None:
        self.sim.workers[worker_id].set_faults(latency_s={})
        self._end(ENGINE_LATENCY, worker_id)

    def fail_loads(self, worker_id: str, count: int) -> None:
        self.sim.workers[worker_id].set_faults(fail_next_loads=count)
        self._begin(ENGINE_ERROR, worker_id)

    def stop_failing_loads(self, worker_id: str) -> None:
        self.sim.workers[worker_id].set_faults(fail_next_loads=0)
        self._end(ENGINE_ERROR, worker_id)

    def hang_engine(self, worker_id: str) -> None:
        self.sim.workers[worker_id].set_faults(hang=True)
        self._begin(ENGINE_HANG, worker_id)

    def unhang_engine(self, worker_id: str) -> None:
        self.sim.workers[worker_id].set_faults(hang=False)
        self._end(ENGINE_HANG, worker_id)

    def restart_engine(self, worker_id: str) -> None:
        """As a restarted engine comes back: no adapters, not paused."""
        worker = self.sim.workers[worker_id]
        self.timeline.instant(ENGINE_RESTART, worker_id)
        for name in list(worker.adapters):
            worker.remove_adapter(name)
        worker.paused = False

    # -- windows -------------------------------------------------------------------

    def _begin(self, kind: str, worker_id: str, latency_s: dict[str, float] | None = None) -> None:
        window = self.timeline.open_window(kind, worker_id, **(latency_s or {}))
        self._open[(kind, worker_id)] = window

    def _end(self, kind: str, worker_id: str, at: float | None = None) -> None:
        window = self._open.pop((kind, worker_id), None)
        if window is not None:
            window.end = now() if at is None else at

    def _node_named(self, subject: str) -> int:
        return next((i for i, n in enumerate(self.nodes) if n.name == subject), 0)

    @property
    def open_faults(self) -> list[tuple[str, str]]:
        return sorted(self._open)

    async def heal(self) -> None:
        """End every fault still holding: the state a fault-free fleet would be in."""
        for kind, worker_id in list(self._open):
            if (kind, worker_id) not in self._open:
                continue  # healed with a node-mate's
            if kind == AGENT_STOPPED:
                self.continue_agent(worker_id)
            elif kind == AGENT_DOWN:
                await self.restart_agent(worker_id)
            elif kind == NATS_DOWN:
                await self.start_nats(self._node_named(worker_id))
            elif kind == NATS_NODE_PARTITIONED:
                self.reconnect_node(self._node_named(worker_id))
            elif kind == COORDINATOR_DOWN:
                await self.replace_coordinator()
            elif kind == COORDINATOR_STOPPED:
                self.continue_coordinator(worker_id)
            elif kind == ENGINE_LATENCY:
                self.unslow_engine(worker_id)
            elif kind == ENGINE_ERROR:
                self.stop_failing_loads(worker_id)
            elif kind == ENGINE_HANG:
                self.unhang_engine(worker_id)
            elif kind == AGENT_PARTITIONED:
                self.heal_agent_partition(worker_id)
            elif kind == COORDINATOR_PARTITIONED:
                self.heal_partition(f"coordinator-{worker_id}", kind, worker_id)


def node_agent_args(node: str, configs: list[AgentConfig], path: Path, nats_url: str) -> list[str]:
    """``agent --node-file`` for ``configs`` on ``node``: each worker's own
    settings in the file (written at ``path``), the settings they share as
    options."""
    first = configs[0]
    lines = [f"node = {json.dumps(node)}", ""]
    for config in configs:
        lines += [
            "[[workers]]",
            f"worker_id = {json.dumps(config.worker_id)}",
            f"system_url = {json.dumps(config.system_url)}",
            f"world_size = {config.world_size}",
            f"cache_dir = {json.dumps(config.cache_dir)}",
            "",
        ]
    path.write_text("\n".join(lines))
    shared = msgspec.structs.replace(first, cache_dir="")
    args = agent_args(shared, nats_url=nats_url)
    # The file names each worker: drop the first one's own flags.
    for flag in ("--worker-id", "--system-url", "--world-size"):
        if flag in args:
            at = args.index(flag)
            del args[at : at + 2]
    return [*args, "--node-file", str(path)]


def _same_again(server: NatsServer) -> NatsServer:
    """A nats-server as ``server`` was: port, store, name, cluster and options."""
    return NatsServer(
        port=server.port,
        store_dir=server.store_dir,
        name=server.name,
        cluster_port=server.cluster_port,
        routes=list(server.routes),
        options=server.options,
    )
