"""``lorabus bench``: the whole run, size by size and mode by mode.

For each fleet size N a fresh nats-server and a simulated fleet of N workers
(its own process) serve, in turn:

- ``floor``: agent hosts in floor role and a gather in this process;
- ``lorabus-null`` / ``lorabus-http``: the real ``lorabus coordinator``
  process, agent hosts with null or Dynamo-driver engines (one worker of an
  HTTP fleet gets a real ``lorabus agent`` process of its own, whose memory is
  "one agent process"), and the requester here, through ``UpdateClient``;
- ``baseline``: the direct-HTTP orchestrator process.

Each mode gets fresh processes and a fleet name of its own, a warm-up, then
the timed updates; CPU and memory come from ``/proc`` of each process. The
processes of a mode are stopped before the next starts, and every process is
stopped when the run ends, also on errors and Ctrl-C. The distribution series
(``distribution.py``) runs after the update modes, on processes of its own,
and the tenants series (``tenants.py``) after it, on its own too.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import platform
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lorabus.agents.config import AgentConfig
from lorabus.bus.connect import close
from lorabus.client import UpdateClient
from lorabus.coordinator.config import CoordinatorConfig, StorageConfig
from lorabus.coordinator.streams import provision
from lorabus.schemas import Subjects, UpdateMode
from lorabus.security.auth_init import write_fleet_auth
from lorabus.security.roles import Role
from lorabus.service_flags import agent_args, coordinator_args
from lorabus.testbed.bench.children import Child, ChildFailed
from lorabus.testbed.bench.config import BenchConfig
from lorabus.testbed.bench.distreport import DistributionResult, judge_distribution
from lorabus.testbed.bench.distribution import run_distribution
from lorabus.testbed.bench.fleet import (
    BenchFailed,
    BenchFleet,
    cpu_of,
    node_groups,
    pause_window,
)
from lorabus.testbed.bench.floor import FloorGather
from lorabus.testbed.bench.frontend import ListingFrontend
from lorabus.testbed.bench.placement import run_placement
from lorabus.testbed.bench.placementreport import PlacementResult, judge_placement
from lorabus.testbed.bench.procinfo import ProcessGone, cpu_seconds, memory_mb, peak_rss_mb
from lorabus.testbed.bench.report import (
    BASELINE,
    FLOOR,
    HTTP,
    LIVE,
    NULL,
    BenchReport,
    ModeResult,
    judge,
    size_ratios,
    stats_of,
)
from lorabus.testbed.bench.tenants import run_tenants
from lorabus.testbed.bench.tenantsreport import TenantResult, judge_tenants
from lorabus.testbed.natsserver import NatsServer
from lorabus.testbed.trainer import write_adapter

log = logging.getLogger(__name__)

Out = Callable[[str], None]

_UPDATE_TIMEOUT_S = 120.0
_MAX_ERRORS_KEPT = 5


async def run_bench(config: BenchConfig, out: Out) -> BenchReport:
    """Run every series of ``config`` (the update modes size by size, the
    distribution series); print progress with ``out``."""
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    load_at_start = os.getloadavg()
    started = time.monotonic()
    own_dir = config.run_dir is None
    run_dir = config.run_dir or Path(tempfile.mkdtemp(prefix="lorabus-bench-"))
    notes: list[str] = []
    unmeasured: list[str] = []
    results: list[ModeResult] = []
    distributed: list[DistributionResult] = []
    tenants: list[TenantResult] = []
    placed: list[PlacementResult] = []
    try:
        if "updates" in config.series:
            results = await _run_updates(config, run_dir, out, unmeasured)
        if "distribution" in config.series:
            distributed = await run_distribution(config, run_dir, out, unmeasured)
        if "tenants" in config.series:
            tenants = await run_tenants(config, run_dir, out, unmeasured)
        if "placement" in config.series:
            placed = await run_placement(config, run_dir, out, unmeasured)
    finally:
        failed = (
            bool(unmeasured)
            or any(r.errors for r in results)
            or any(r.errors for r in distributed)
            or any(r.errors for r in tenants)
            or any(r.errors for r in placed)
        )
        if own_dir and not failed:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif failed:
            notes.append(f"logs kept in {run_dir}")
    ratios = size_ratios(results)
    targets = judge(results, ratios) if "updates" in config.series else []
    return BenchReport(
        started_at=started_at,
        elapsed_s=round(time.monotonic() - started, 1),
        machine={
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_at_start": [round(x, 2) for x in load_at_start],
        },
        settings=_settings(config),
        results=results,
        ratios=ratios,
        targets=targets
        + judge_distribution(distributed)
        + judge_tenants(tenants)
        + judge_placement(placed),
        unmeasured=unmeasured,
        notes=notes,
        distribution=distributed,
        tenants=tenants,
        placement=placed,
    )


async def _run_updates(
    config: BenchConfig, run_dir: Path, out: Out, unmeasured: list[str]
) -> list[ModeResult]:
    """Every size and mode of the update series."""
    results: list[ModeResult] = []
    adapter = write_adapter(run_dir / "adapters", 1, base_model="sim-base")
    cases: list[tuple[str, int, float, float, Sequence[str]]] = [
        ("main", n, config.load_latency_s, config.load_jitter_s, config.modes) for n in config.sizes
    ]
    window = config.window_case
    if window is not None:
        window_modes = [m for m in ("null", "http", "baseline") if m in config.modes]
        cases.append(
            ("window", window.n, window.load_latency_s, window.load_jitter_s, window_modes)
        )
    for case, n, latency, jitter, modes in cases:
        size = _SizeRun(config, case, n, latency, jitter, str(adapter), run_dir, out)
        results.extend(await size.run(modes, unmeasured))
    return results


def _settings(config: BenchConfig) -> dict[str, Any]:
    settings = asdict(config)
    settings["run_dir"] = None
    sizes = sorted(
        {*config.sizes, *config.distribution.sizes, *config.tenants.sizes, *config.placement.sizes}
    )
    settings["heartbeat_s"] = {n: config.heartbeat_for(n) for n in sizes}
    return settings


class _SizeRun(BenchFleet):
    """Every mode at one fleet size, on a nats-server and a simulated fleet of its own."""

    def __init__(
        self,
        config: BenchConfig,
        case: str,
        n: int,
        latency: float,
        jitter: float,
        adapter_path: str,
        run_dir: Path,
        out: Out,
    ) -> None:
        super().__init__(config, case, n, latency, jitter, run_dir / f"{case}-n{n}")
        self.adapter_path = adapter_path
        self.out = out
        self.updates = config.updates_for(case)
        self.listing: ListingFrontend | None = None

    async def run(self, modes: Sequence[str], unmeasured: list[str]) -> list[ModeResult]:
        plan: list[tuple[str, str]] = []
        for mode in ("floor", "null", "http", "live", "baseline"):
            if mode not in modes:
                continue
            layouts = {"floor": self.config.connections, "null": self.config.connections}.get(
                mode, self.config.http_connections if mode in ("http", "live") else ("-",)
            )
            if self.case == "window" and layouts != ("-",):
                layouts = layouts[:1]  # one layout per mode: the first given
            plan.extend((mode, layout) for layout in layouts)
        results: list[ModeResult] = []
        async with NatsServer() as nats, self.children, ListingFrontend() as listing:
            self.nats, self.listing = nats, listing
            if {"http", "live", "baseline"} & set(modes):
                await self.start_sim()
            for mode, layout in plan:
                label = mode if layout == "-" else f"{mode}/{layout}"
                started = time.monotonic()
                try:
                    result = await self._measure(mode, layout)
                except (BenchFailed, ChildFailed, ProcessGone) as exc:
                    unmeasured.append(f"N={self.n} {self.case} {label}: {exc}")
                    self.out(f"N={self.n} {self.case} {label}: failed: {exc}")
                    continue
                results.append(result)
                self.out(
                    f"N={self.n} {self.case} {label}: p50 {result.wall_s.p50 * 1000:.1f} ms, "
                    f"p95 {result.wall_s.p95 * 1000:.1f} ms over {result.updates} updates"
                    + (f", {result.failed} failed" if result.failed else "")
                    + f" ({time.monotonic() - started:.0f}s)"
                )
        return results

    async def _measure(self, mode: str, layout: str) -> ModeResult:
        if mode == "baseline":
            return await self._baseline()
        engine = "null" if mode == "null" else "http"
        fleet = (
            f"floor-{layout}-n{self.n}" if mode == "floor" else f"bench-{mode}-{layout}-n{self.n}"
        )
        async with self._bus_for(fleet, layout):
            if mode == "floor":
                return await self._floor(fleet, layout)
            return await self._lorabus(fleet, engine, layout, live=mode == "live")

    @contextlib.asynccontextmanager
    async def _bus_for(self, fleet: str, layout: str) -> AsyncIterator[None]:
        """The NATS of one mode: the size's shared server, or in a secure run a
        server of its own, started from ``lorabus auth init``'s configuration for
        the mode's fleet and set up by its operator, as a deployment would be."""
        if not self.config.secure:
            yield
            return
        shared = self.nats
        nodes = node_groups(list(self.workers)) if layout == "node" else {}
        auth = write_fleet_auth(
            self.log_dir / f"auth-{fleet}",
            Subjects(fleet=fleet),
            [] if nodes else list(self.workers),
            tls=True,
            nodes=nodes,
        )
        # Thousands of identities make a configuration of megabytes (an
        # account per agent: 15 MB at N = 4096), which takes seconds to load.
        async with NatsServer(include=auth.server_conf, start_timeout_s=120.0) as server:
            self.nats, self.auth = server, auth
            try:
                nc = await self.connect(Role.OPERATOR, name="bench-operator")
                try:
                    await provision(nc, StorageConfig(fleet=fleet))
                finally:
                    await close(nc)
                yield
            finally:
                self.nats, self.auth = shared, None

    def _result(self, mode: str, layout: str, **figures: Any) -> ModeResult:
        return ModeResult(
            mode=mode,
            connections=layout,
            case=self.case,
            n=self.n,
            world_size=self.world_size,
            load_latency_s=self.latency,
            load_jitter_s=self.jitter,
            **figures,
        )

    # -- the bus floor -------------------------------------------------------------

    async def _floor(self, fleet: str, layout: str) -> ModeResult:
        assert self.nats is not None
        setup_started = time.monotonic()
        hosts = await self.start_hosts("floor", fleet, self.workers, layout)
        nc = await self.connect(Role.COORDINATOR, name="bench-floor")
        try:
            # One echo per connection: per worker, or per node in the node layout.
            echoes = len(node_groups(list(self.workers))) if layout == "node" else self.n
            gather = FloorGather(nc, Subjects(fleet=fleet), echoes)
            await gather.start()
            setup_s = time.monotonic() - setup_started
            for _ in range(self.config.warmup):
                await gather.update()
            nats_cpu = cpu_seconds(self.nats.process.pid)  # type: ignore[union-attr]
            hosts_cpu = cpu_of(hosts)
            foreign = self.foreign_load(hosts)
            walls, rounds = [], []
            for _ in range(self.updates):
                times = await gather.update()
                walls.append(sum(times))
                rounds.extend(times)
            count = self.updates
            return self._result(
                FLOOR,
                layout,
                updates=count,
                failed=0,
                wall_s=stats_of(walls),
                wall_samples_s=[round(w, 6) for w in walls],
                phases_s={"round": stats_of(rounds)},
                setup_s=round(setup_s, 3),
                agents_cpu_s_per_update=(cpu_of(hosts) - hosts_cpu) / count,
                agent_hosts=len(hosts),
                agents_per_host=-(-self.n // len(hosts)),
                agent_host_peak_rss_mb=max(peak_rss_mb(h.pid) for h in hosts),
                nats_cpu_s_per_update=(
                    cpu_seconds(self.nats.process.pid) - nats_cpu  # type: ignore[union-attr]
                )
                / count,
                foreign_load=foreign.share(),
            )
        finally:
            await close(nc)
            await self.children.stop_all(hosts)

    # -- lorabus ------------------------------------------------------------------

    async def _lorabus(
        self, fleet: str, engine: str, layout: str, *, live: bool = False
    ) -> ModeResult:
        assert self.nats is not None and self.listing is not None
        adapter = f"bench-{'live' if live else engine}-{layout}"
        frontend_url = self.sim_url if engine == "http" else self.listing.url
        setup_started = time.monotonic()
        coordinator_config = CoordinatorConfig(
            fleet=fleet,
            frontend_url=frontend_url,
            expected_world_size=self.world_size,
            quorum_timeout_s=120,
            phase_timeout_s=60,
            verify_timeout_s=30,
            keep=self.config.keep_versions(),
            mode=UpdateMode.LIVE if live else UpdateMode.PAUSE,
            canary=self.config.canary,
        )
        coordinator = await self.children.lorabus(
            f"{fleet}-coordinator",
            coordinator_args(coordinator_config, nats_url=self.nats_url),
            env=self.identity_env(Role.COORDINATOR),
        )
        hosted = dict(self.workers)
        single: Child | None = None
        agents: list[Child] = []
        nc = None
        try:
            if engine == "http" and self.n > 1 and layout != "node":
                # One worker gets a deployed agent: a `lorabus agent` process of its own.
                wid, size = hosted.popitem()
                agent_config = AgentConfig(
                    fleet=fleet,
                    worker_id=wid,
                    system_url=self.system_url(wid),
                    frontend_url=self.sim_urls[wid],
                    world_size=size,
                    heartbeat_s=self.heartbeat_s,
                )
                single = await self.children.lorabus(
                    f"{fleet}-agent-{wid}",
                    agent_args(agent_config, nats_url=self.nats_url),
                    env=self.identity_env(Role.AGENT, wid),
                )
            agents = await self.start_hosts("agents", fleet, hosted, layout, engine)
            nc = await self.connect(Role.ORCHESTRATOR, name="bench-requester")
            client = UpdateClient(nc, fleet)
            await self.wait_fleet_ready(
                client, [coordinator, *agents, *([single] if single else [])]
            )
            setup_s = time.monotonic() - setup_started
            idle_from = cpu_seconds(coordinator.pid)
            await asyncio.sleep(self.config.idle_s)
            idle_rate = (cpu_seconds(coordinator.pid) - idle_from) / self.config.idle_s
            version = 0
            for _ in range(self.config.warmup):
                version += 1
                await self._update(client, adapter, version, engine)
            await asyncio.gather(*(h.ask("times") for h in agents))
            rss_before = memory_mb(coordinator.pid)[0]
            measured = [coordinator, *agents, *([single] if single else [])]
            foreign = self.foreign_load(measured)
            counters = {
                "coordinator": cpu_seconds(coordinator.pid),
                "agents": cpu_of([c for c in measured if c is not coordinator]),
                "nats": cpu_seconds(self.nats.process.pid),  # type: ignore[union-attr]
                "sim": self.sim_cpu_s(),
            }
            walls: list[float] = []
            phases: dict[str, list[float]] = {}
            windows: list[float] = []
            slowest: list[float] = []
            over: list[float] = []
            errors: list[str] = []
            for _ in range(self.updates):
                version += 1
                drawn = 0.0
                if engine == "http" and self.sims:
                    drawn = await self.draw_loads()
                wall, result = await self._update(client, adapter, version, engine)
                engines = await asyncio.gather(*(h.ask("times") for h in agents))
                if engine == "null":
                    drawn = max(e["slowest_load_s"] for e in engines) if self.latency > 0 else 0.0
                if not result.committed:
                    message = result.error.message if result.error else result.status
                    errors.append(f"v{version}: {message}")
                    continue
                walls.append(wall)
                for name, seconds in result.phases.items():
                    phases.setdefault(name, []).append(seconds)
                phases.setdefault("other", []).append(wall - sum(result.phases.values()))
                window = pause_window(engines)
                if window is None and live:
                    window = 0.0  # no engine paused: the pause window is nil
                if window is not None:
                    windows.append(window)
                    if drawn > 0:
                        slowest.append(drawn)
                        over.append(window / drawn)
            count = self.updates
            if not walls:
                raise BenchFailed(f"no update committed: {errors[:1]}")
            per_update = {
                "coordinator": cpu_seconds(coordinator.pid) - counters["coordinator"],
                "agents": cpu_of([c for c in measured if c is not coordinator])
                - counters["agents"],
                "nats": cpu_seconds(self.nats.process.pid)  # type: ignore[union-attr]
                - counters["nats"],
                "sim": self.sim_cpu_s() - counters["sim"],
            }
            return self._result(
                NULL if engine == "null" else LIVE if live else HTTP,
                layout,
                updates=count,
                failed=len(errors),
                wall_s=stats_of(walls),
                wall_samples_s=[round(w, 6) for w in walls],
                phases_s={name: stats_of(values) for name, values in phases.items()},
                setup_s=round(setup_s, 3),
                pause_window_s=stats_of(windows) if windows else None,
                slowest_load_s=stats_of(slowest) if slowest else None,
                window_over_slowest_load=stats_of(over) if over else None,
                central_cpu_s_per_update=per_update["coordinator"] / count,
                central_peak_rss_mb=peak_rss_mb(coordinator.pid),
                central_rss_growth_mb_per_update=round(
                    (memory_mb(coordinator.pid)[0] - rss_before) / count, 4
                ),
                central_idle_cpu_s_per_s=round(idle_rate, 6),
                agents_cpu_s_per_update=per_update["agents"] / count,
                agent_hosts=len(agents),
                agents_per_host=-(-len(hosted) // len(agents)),
                agent_host_peak_rss_mb=max(peak_rss_mb(h.pid) for h in agents),
                single_agent_peak_rss_mb=peak_rss_mb(single.pid) if single else None,
                nats_cpu_s_per_update=per_update["nats"] / count,
                sim_cpu_s_per_update=per_update["sim"] / count if engine == "http" else None,
                heartbeat_s=self.heartbeat_s,
                foreign_load=foreign.share(),
                errors=errors[:_MAX_ERRORS_KEPT],
            )
        finally:
            if nc is not None:
                await close(nc)
            # The coordinator first, so that no update is left half done.
            await self.children.stop(coordinator)
            await self.children.stop_all([*agents, *([single] if single else [])])

    async def _update(
        self, client: UpdateClient, adapter: str, version: int, engine: str
    ) -> tuple[float, Any]:
        if engine == "null":
            assert self.listing is not None
            self.listing.announce(f"{adapter}-v{version}")
        started = time.perf_counter()
        result = await client.update(
            adapter, self.adapter_path, version=version, timeout_s=_UPDATE_TIMEOUT_S
        )
        return time.perf_counter() - started, result

    # -- the direct-HTTP baseline ---------------------------------------------------

    async def _baseline(self) -> ModeResult:
        assert self.sims and self.nats is not None
        setup_started = time.monotonic()
        spec = {
            "workers": {wid: self.system_url(wid) for wid in self.workers},
            "frontend_url": self.sim_url,
            "timeout_s": 60.0,
        }
        child, ready = await self.children.bench_child(
            f"baseline-n{self.n}", "baseline", spec, ready_timeout_s=self.ready_timeout_s()
        )
        try:
            timeout = _UPDATE_TIMEOUT_S
            version = 0
            for _ in range(self.config.warmup):
                version += 1
                await child.ask(
                    "update", timeout, name=f"baseline-v{version}", path=self.adapter_path
                )
            setup_s = time.monotonic() - setup_started
            central = cpu_seconds(child.pid)
            foreign = self.foreign_load([child])
            sim = self.sim_cpu_s()
            walls: list[float] = []
            phases: dict[str, list[float]] = {}
            windows: list[float] = []
            slowest: list[float] = []
            over: list[float] = []
            errors: list[str] = []
            for _ in range(self.updates):
                version += 1
                drawn = await self.draw_loads()
                figures = await child.ask(
                    "update", timeout, name=f"baseline-v{version}", path=self.adapter_path
                )
                if not figures["ok"]:
                    errors.append(f"v{version}: {figures['message']}")
                    continue
                walls.append(figures["wall_s"])
                for name, seconds in figures["phases"].items():
                    phases.setdefault(name, []).append(seconds)
                phases.setdefault("other", []).append(
                    figures["wall_s"] - sum(figures["phases"].values())
                )
                window = figures["last_resume"] - figures["first_pause"]
                windows.append(window)
                if drawn > 0:
                    slowest.append(drawn)
                    over.append(window / drawn)
            count = self.updates
            if not walls:
                raise BenchFailed(f"no update succeeded: {errors[:1]}")
            return self._result(
                BASELINE,
                "-",
                updates=count,
                failed=len(errors),
                wall_s=stats_of(walls),
                wall_samples_s=[round(w, 6) for w in walls],
                phases_s={name: stats_of(values) for name, values in phases.items()},
                setup_s=round(setup_s, 3),
                pause_window_s=stats_of(windows),
                slowest_load_s=stats_of(slowest) if slowest else None,
                window_over_slowest_load=stats_of(over) if over else None,
                central_cpu_s_per_update=(cpu_seconds(child.pid) - central) / count,
                central_peak_rss_mb=peak_rss_mb(child.pid),
                sim_cpu_s_per_update=(self.sim_cpu_s() - sim) / count,
                setup_cpu_s=round(ready["setup_cpu_s"], 3),
                foreign_load=foreign.share(),
                errors=errors[:_MAX_ERRORS_KEPT],
            )
        finally:
            await self.children.stop(child)
