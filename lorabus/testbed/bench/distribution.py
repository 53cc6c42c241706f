"""``lorabus bench --series distribution``: an adapter of S MB to N agents, three ways.

For each fleet size N, one set of processes: a nats-server with its
monitoring port (``-m``, for ``/varz``'s ``out_bytes``), the simulated Dynamo
fleet, the real ``lorabus coordinator``, N agents with the Dynamo driver in
the agent host processes (``--agents-per-node`` of them per node: a node is
one cache directory under the run's folder, ``nodes/node<k>/cache``), and
for the reference a trainer-side file server and one puller process per
agent host (``httppull``). Then for each adapter size S, after warm-ups,
repetitions of the three ways one after the other, so that the machine's
drift weighs on all three alike:

- ``bus``: the adapter pushed with ``UpdateClient.push_adapter`` (timed on
  its own: the trainer's cost), then ``update(digest=...)``, timed from the
  request to the committed result; each node's agents fetch it into their
  cache in the prepare phase, then load the cached directory;
- ``path``: the adapter written into a shared folder, then an update in path
  mode with its digest (each agent checks it, as the bus path does);
- ``http-pull``: every node pulls the files from the file server into
  ``nodes/node<k>/pulled``, all nodes at once, and hashes its copy; then a
  path-mode update (with the digest) naming node 0's copy, the same path for
  every worker as path mode needs. Timed from the first pull to the result.

Every update gets an adapter of fresh content (a new digest), written and
synced to disk (``os.sync``) before anything is timed; the push is synced
before its update too. After each repetition the adapters before it leave
the trainer's folder, the shared folder, the nodes and the object store, so
the disk holds a few copies at a time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from lorabus.adapters.digest import adapter_digest
from lorabus.adapters.store import delete_object
from lorabus.bus.connect import close
from lorabus.client import UpdateClient
from lorabus.coordinator.config import CoordinatorConfig, StorageConfig
from lorabus.coordinator.streams import provision
from lorabus.errors import LorabusError
from lorabus.schemas import Subjects, UpdateMode, UpdateResult
from lorabus.security.roles import Role
from lorabus.service_flags import coordinator_args
from lorabus.testbed.bench.children import Child, ChildFailed
from lorabus.testbed.bench.config import BenchConfig
from lorabus.testbed.bench.distreport import BUS, HTTP_PULL, PATH, WAYS, DistributionResult
from lorabus.testbed.bench.figures import Stats, stats_of
from lorabus.testbed.bench.fleet import BenchFailed, BenchFleet, cpu_of, pause_window
from lorabus.testbed.bench.procinfo import ProcessGone, cpu_seconds
from lorabus.testbed.natsserver import NatsServer, free_port

log = logging.getLogger(__name__)

Out = Callable[[str], None]

_MB = 1 << 20
_UPDATE_TIMEOUT_S = 600.0
_VARZ_TIMEOUT_S = 5.0
_MAX_ERRORS_KEPT = 5
_ADAPTERS = {BUS: "dist-bus", PATH: "dist-path", HTTP_PULL: "dist-pull"}
_FILES = ("adapter_config.json", "adapter_model.safetensors")


async def run_distribution(
    config: BenchConfig, run_dir: Path, out: Out, unmeasured: list[str]
) -> list[DistributionResult]:
    """Every point of ``config.distribution``; what could not be measured goes
    to ``unmeasured``."""
    results: list[DistributionResult] = []
    for n in config.distribution.sizes:
        fleet = _NodeFleet(config, n, run_dir, out)
        try:
            results.extend(await fleet.run(unmeasured))
        except (BenchFailed, ChildFailed, ProcessGone) as exc:
            unmeasured.append(f"distribution N={n}: {exc}")
            out(f"distribution N={n}: failed: {exc}")
    return results


def write_sized_adapter(directory: Path, megabytes: int) -> Path:
    """A PEFT-shaped adapter directory whose weights are ``megabytes`` MB of
    random bytes: the simulated engines look for the files, never into them."""
    directory.mkdir(parents=True)
    config = {"peft_type": "LORA", "base_model_name_or_path": "sim-base", "r": 8}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    with (directory / "adapter_model.safetensors").open("wb") as weights:
        for _ in range(megabytes):
            weights.write(os.urandom(_MB))
    return directory


class _Failed(Exception):
    """Raised when one update of a way did not commit (or its pulls went wrong)."""


@dataclass(frozen=True)
class _Parts:
    """The processes of one fleet size, and the requester's client."""

    coordinator: Child
    hosts: list[Child]
    server: Child
    server_url: str
    pullers: list[Child]
    client: UpdateClient
    http: aiohttp.ClientSession


@dataclass
class _Sample:
    """One timed update of one way."""

    wall_s: float
    phases: dict[str, float]
    window_s: float | None
    nats_bytes: int
    cpu: dict[str, float]
    push_s: float | None = None
    pull_s: float | None = None
    update_s: float | None = None
    http_bytes: int | None = None


@dataclass
class _Samples:
    """The timed updates of one way at one point."""

    taken: list[_Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class _NodeFleet(BenchFleet):
    """Every adapter size at one fleet size, on processes of its own."""

    def __init__(self, config: BenchConfig, n: int, run_dir: Path, out: Out) -> None:
        # Absolute: a path-mode update names a directory, and agents take no other.
        log_dir = run_dir.resolve() / f"distribution-n{n}"
        super().__init__(config, "distribution", n, 0.0, 0.0, log_dir)
        self.plan = config.distribution
        self.out = out
        self.fleet = f"bench-dist-n{n}"
        self.subjects = Subjects(fleet=self.fleet)
        self.trainer_dir = self.log_dir / "trainer"
        self.shared_dir = self.log_dir / "shared"
        nodes = self.plan.nodes_for(n)
        self.nodes = [self.log_dir / "nodes" / f"node{k}" for k in range(nodes)]
        per_node = self.plan.agents_per_node
        self.cache_dirs = {
            wid: str(self.nodes[i // per_node] / "cache") for i, wid in enumerate(self.workers)
        }
        self.monitor_port = free_port()
        self.version = 0
        self.written = 0
        self.stored: list[str] = []
        """Digests pushed to the object store and not deleted yet."""

    def _keep(self) -> int:
        """Every version of the run stays loaded (nothing retired between updates)."""
        return (self.plan.warmup + self.plan.updates) * len(self.plan.adapter_mb) + 1

    async def run(self, unmeasured: list[str]) -> list[DistributionResult]:
        results: list[DistributionResult] = []
        setup_started = time.monotonic()
        monitor = ["-m", str(self.monitor_port)]
        async with (
            NatsServer(options=monitor) as nats,
            self.children,
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_VARZ_TIMEOUT_S)) as http,
        ):
            self.nats = nats
            await self.start_sim()
            operator = await self.connect(Role.OPERATOR, name="bench-operator")
            try:
                await provision(operator, StorageConfig(fleet=self.fleet))
            finally:
                await close(operator)
            coordinator = await self.children.lorabus(
                f"{self.fleet}-coordinator",
                coordinator_args(self._coordinator_config(), nats_url=self.nats_url),
            )
            hosts: list[Child] = []
            pullers: list[Child] = []
            nc = None
            try:
                hosts = await self.start_hosts(
                    "agents", self.fleet, self.workers, "own", "http", cache_dirs=self.cache_dirs
                )
                server, pullers, server_url = await self._start_http_pull(len(hosts))
                nc = await self.connect(Role.ORCHESTRATOR, name="bench-requester")
                client = UpdateClient(nc, self.fleet)
                await self.wait_fleet_ready(client, [coordinator, *hosts])
                setup_s = time.monotonic() - setup_started
                parts = _Parts(coordinator, hosts, server, server_url, pullers, client, http)
                for megabytes in self.plan.adapter_mb:
                    where = f"distribution N={self.n} S={megabytes} MB"
                    started = time.monotonic()
                    try:
                        measured = await self._point(parts, megabytes, setup_s)
                    except (BenchFailed, ChildFailed, ProcessGone) as exc:
                        unmeasured.append(f"{where}: {exc}")
                        self.out(f"{where}: failed: {exc}")
                        continue
                    results.extend(measured)
                    self.out(
                        f"{where}: "
                        + ", ".join(f"{r.series} p50 {r.wall_s.p50:.2f} s" for r in measured)
                        + f" ({time.monotonic() - started:.0f}s)"
                    )
            finally:
                if nc is not None:
                    await close(nc)
                # The coordinator first, so that no update is left half done.
                await self.children.stop(coordinator)
                await self.children.stop_all([*hosts, *pullers])
                # The logs stay (with --run-dir, or after a failure); the adapters go.
                for folder in (self.trainer_dir, self.shared_dir, self.log_dir / "nodes"):
                    await asyncio.to_thread(shutil.rmtree, folder, ignore_errors=True)
        return results

    def _coordinator_config(self) -> CoordinatorConfig:
        return CoordinatorConfig(
            fleet=self.fleet,
            frontend_url=self.sim_url,
            expected_world_size=self.world_size,
            quorum_timeout_s=120,
            phase_timeout_s=300,
            verify_timeout_s=60,
            keep=self._keep(),
            mode=UpdateMode.PAUSE,
        )

    async def _start_http_pull(self, count: int) -> tuple[Child, list[Child], str]:
        """The file server over the trainer's folder, and ``count`` pullers."""
        self.trainer_dir.mkdir(parents=True, exist_ok=True)
        server, ready = await self.children.bench_child(
            "file-server", "httppull", {"role": "server", "root": str(self.trainer_dir)}
        )
        spec = {"role": "puller", "timeout_s": _UPDATE_TIMEOUT_S}
        started = await asyncio.gather(
            *(self.children.bench_child(f"puller{i}", "httppull", spec) for i in range(count))
        )
        return server, [child for child, _ in started], ready["url"]

    # -- one point -----------------------------------------------------------------

    async def _point(
        self, parts: _Parts, megabytes: int, setup_s: float
    ) -> list[DistributionResult]:
        samples = {way: _Samples() for way in WAYS}
        measured = [parts.coordinator, *parts.hosts, parts.server, *parts.pullers]
        foreign = self.foreign_load(measured)
        for repetition in range(self.plan.warmup + self.plan.updates):
            timed = repetition >= self.plan.warmup
            for way in WAYS:
                try:
                    sample = await self._once(parts, way, megabytes)
                except (_Failed, LorabusError) as exc:
                    if timed:
                        samples[way].errors.append(str(exc))
                    else:
                        log.warning("a warm-up update failed: %s", exc)
                    continue
                if timed:
                    samples[way].taken.append(sample)
            await self._clear()
        share = foreign.share()
        return [
            self._result(way, megabytes, samples[way], setup_s=setup_s, foreign_load=share)
            for way in WAYS
        ]

    async def _once(self, parts: _Parts, way: str, megabytes: int) -> _Sample:
        if way == BUS:
            return await self._bus(parts, megabytes)
        if way == PATH:
            return await self._path(parts, megabytes)
        return await self._pull(parts, megabytes)

    async def _bus(self, parts: _Parts, megabytes: int) -> _Sample:
        adapter = await self._write(self.trainer_dir, BUS, megabytes)
        started = time.perf_counter()
        digest = await parts.client.push_adapter(adapter)
        push_s = time.perf_counter() - started
        self.stored.append(digest)
        await asyncio.to_thread(os.sync)
        before = await self._start_counting(parts)
        started = time.perf_counter()
        result = await parts.client.update(
            _ADAPTERS[BUS], digest=digest, version=self._next(), timeout_s=_UPDATE_TIMEOUT_S
        )
        wall = time.perf_counter() - started
        return await self._sample(parts, result, wall, before, push_s=push_s)

    async def _path(self, parts: _Parts, megabytes: int) -> _Sample:
        adapter = await self._write(self.shared_dir, PATH, megabytes)
        digest = await asyncio.to_thread(adapter_digest, adapter)
        before = await self._start_counting(parts)
        started = time.perf_counter()
        result = await parts.client.update(
            _ADAPTERS[PATH],
            str(adapter),
            digest=digest,
            version=self._next(),
            timeout_s=_UPDATE_TIMEOUT_S,
        )
        wall = time.perf_counter() - started
        return await self._sample(parts, result, wall, before)

    async def _pull(self, parts: _Parts, megabytes: int) -> _Sample:
        adapter = await self._write(self.trainer_dir, HTTP_PULL, megabytes)
        digest = await asyncio.to_thread(adapter_digest, adapter)
        await parts.server.ask("served")  # counting from now
        before = await self._start_counting(parts)
        started = time.perf_counter()
        shares = [self.nodes[i :: len(parts.pullers)] for i in range(len(parts.pullers))]
        answers = await asyncio.gather(
            *(
                puller.ask(
                    "pull",
                    _UPDATE_TIMEOUT_S,
                    url=parts.server_url,
                    adapter=adapter.name,
                    files=list(_FILES),
                    nodes=[str(node / "pulled") for node in share],
                )
                for puller, share in zip(parts.pullers, shares, strict=True)
                if share
            )
        )
        pulled = time.perf_counter()
        wrong = [
            f"{node}: {copy['digest']}"
            for answer in answers
            for node, copy in answer["nodes"].items()
            if copy["digest"] != digest
        ]
        if wrong:
            raise _Failed(f"pulled copies that are not {digest}: {wrong[:2]}")
        copy = self.nodes[0] / "pulled" / adapter.name
        result = await parts.client.update(
            _ADAPTERS[HTTP_PULL],
            str(copy),
            digest=digest,
            version=self._next(),
            timeout_s=_UPDATE_TIMEOUT_S,
        )
        ended = time.perf_counter()
        served = (await parts.server.ask("served"))["bytes"]
        sample = await self._sample(parts, result, ended - started, before, update_s=ended - pulled)
        sample.pull_s = pulled - started
        sample.http_bytes = served
        return sample

    async def _sample(
        self,
        parts: _Parts,
        result: UpdateResult,
        wall: float,
        before: dict[str, float],
        *,
        push_s: float | None = None,
        update_s: float | None = None,
    ) -> _Sample:
        """``update_s``: the update's own part of ``wall`` (default all of it)."""
        engines = await asyncio.gather(*(h.ask("times") for h in parts.hosts))
        after = await self._counters(parts)
        if not result.committed:
            message = result.error.message if result.error else result.status
            raise _Failed(f"v{result.version}: {message}")
        phases = dict(result.phases)
        phases["other"] = (wall if update_s is None else update_s) - sum(result.phases.values())
        return _Sample(
            wall_s=wall,
            phases=phases,
            window_s=pause_window(engines),
            nats_bytes=int(after["nats_out_bytes"] - before["nats_out_bytes"]),
            cpu={name: after[name] - before[name] for name in after if name != "nats_out_bytes"},
            push_s=push_s,
            update_s=update_s,
        )

    async def _start_counting(self, parts: _Parts) -> dict[str, float]:
        """The engines' times start afresh; the counters as they stand."""
        await asyncio.gather(*(h.ask("times") for h in parts.hosts))
        return await self._counters(parts)

    async def _counters(self, parts: _Parts) -> dict[str, float]:
        """What the nats-server has sent so far, and each process's CPU seconds."""
        assert self.nats is not None and self.nats.process is not None and self.sims
        url = f"http://127.0.0.1:{self.monitor_port}/varz"
        async with parts.http.get(url) as response:
            response.raise_for_status()
            varz = await response.json()
        return {
            "nats_out_bytes": float(varz["out_bytes"]),
            "coordinator": cpu_seconds(parts.coordinator.pid),
            "agents": cpu_of(parts.hosts),
            "nats": cpu_seconds(self.nats.process.pid),
            "sim": self.sim_cpu_s(),
            "file_server": cpu_seconds(parts.server.pid),
            "pullers": cpu_of(parts.pullers),
        }

    def _next(self) -> int:
        self.version += 1
        return self.version

    async def _write(self, folder: Path, way: str, megabytes: int) -> Path:
        """A fresh adapter under ``folder``, on disk before anything is timed."""
        self.written += 1
        directory = folder / f"{way}-{megabytes}mb-{self.written}"
        await asyncio.to_thread(write_sized_adapter, directory, megabytes)
        await asyncio.to_thread(os.sync)
        return directory

    async def _clear(self) -> None:
        """Remove the adapters of the repetitions before: every folder's copies,
        every cache entry but the newest, every stored object but the newest.
        The simulated engines read no file after a load."""
        keep = self.stored[-1].removeprefix("sha256:") if self.stored else ""

        def remove() -> None:
            for folder in (self.trainer_dir, self.shared_dir, *(n / "pulled" for n in self.nodes)):
                if folder.is_dir():
                    for item in folder.iterdir():
                        shutil.rmtree(item)
            for node in self.nodes:
                cache = node / "cache"
                if cache.is_dir():
                    for item in cache.iterdir():
                        if len(item.name) == 64 and item.name != keep:
                            shutil.rmtree(item)

        await asyncio.to_thread(remove)
        old, self.stored = self.stored[:-1], self.stored[-1:]
        if old:
            # Only the coordinator's identity may delete from the store.
            nc = await self.connect(Role.COORDINATOR, name="bench-store-clearer")
            try:
                for digest in old:
                    await delete_object(nc, self.subjects, digest)
            finally:
                await close(nc)
        await asyncio.to_thread(os.sync)

    def _result(
        self,
        way: str,
        megabytes: int,
        samples: _Samples,
        *,
        setup_s: float,
        foreign_load: float | None,
    ) -> DistributionResult:
        taken = samples.taken
        if not taken:
            raise BenchFailed(f"no {way} update committed: {samples.errors[:1]}")
        count = len(taken)
        phases: dict[str, list[float]] = {}
        for sample in taken:
            for name, seconds in sample.phases.items():
                phases.setdefault(name, []).append(seconds)
        windows = [s.window_s for s in taken if s.window_s is not None]

        def stats(values: list[float | None]) -> Stats | None:
            present = [v for v in values if v is not None]
            return stats_of(present) if present else None

        http_bytes = [s.http_bytes for s in taken if s.http_bytes is not None]
        return DistributionResult(
            series=way,
            n=self.n,
            world_size=self.world_size,
            adapter_mb=megabytes,
            nodes=len(self.nodes),
            agents_per_node=self.plan.agents_per_node,
            updates=self.plan.updates,
            failed=len(samples.errors),
            wall_s=stats_of([s.wall_s for s in taken]),
            wall_samples_s=[round(s.wall_s, 6) for s in taken],
            phases_s={name: stats_of(values) for name, values in phases.items()},
            pause_window_s=stats_of(windows) if windows else None,
            push_s=stats([s.push_s for s in taken]),
            pull_s=stats([s.pull_s for s in taken]),
            update_s=stats([s.update_s for s in taken]),
            nats_out_bytes_per_update=sum(s.nats_bytes for s in taken) / count,
            file_server_bytes_per_update=sum(http_bytes) / count if http_bytes else None,
            cpu_s_per_update={
                name: round(sum(s.cpu[name] for s in taken) / count, 6) for name in taken[0].cpu
            },
            setup_s=round(setup_s, 3),
            foreign_load=foreign_load,
            errors=samples.errors[:_MAX_ERRORS_KEPT],
        )
