"""``lorabus bench --series tenants``: T trainers, each updating its own adapter.

For each fleet size N, a nats-server and a listing frontend; for each mode
(live, pause) the real ``lorabus coordinator`` in that ``--mode`` (with
``--max-concurrent`` at least the most tenants) and N agents with null
engines in the agent host processes, each agent on its own connection (or,
``--tenant-connections node``, node agents of 8 workers), as the
``lorabus-null`` mode of the update series runs them. Then for each T,
on those processes: tenants ``tenant-0`` .. ``tenant-<T-1>``, each with an
adapter directory of its own, first ``warmup`` updates each (all tenants at
once), then the timed window: every tenant requests its next version as soon
as its previous one is answered, until the window ends; the updates then in
flight are answered and timed, and counted in the rounds and pauses, not in
the updates per second.

What the engines went through comes from the agent hosts (each engine's
running-to-paused transitions); the rounds come from the fleet's commands on
the bus, which this process follows: each pause names its update and the
others of its round (``shared_with``), and every distinct such set is one
round, one pause the coordinator asked every engine for. The coordinator
keeps ``--keep`` versions (default 2, its own default), so the engines'
lists stay the size a long training run sees.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from lorabus.bus.connect import close, flushed
from lorabus.client import UpdateClient
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.errors import LorabusError
from lorabus.schemas import PauseCommand, Subjects, UpdateMode, UpdateResult, encode
from lorabus.schemas.codec import BadPayload, command_decoder
from lorabus.security.roles import Role
from lorabus.service_flags import coordinator_args
from lorabus.testbed.bench.children import Child, ChildFailed
from lorabus.testbed.bench.config import BenchConfig
from lorabus.testbed.bench.figures import Stats, stats_of
from lorabus.testbed.bench.fleet import BenchFailed, BenchFleet, cpu_of
from lorabus.testbed.bench.frontend import ListingFrontend
from lorabus.testbed.bench.procinfo import ForeignLoad, ProcessGone, cpu_seconds
from lorabus.testbed.bench.tenantsreport import PAUSE, TenantResult, percentile
from lorabus.testbed.natsserver import NatsServer
from lorabus.testbed.trainer import write_adapter

log = logging.getLogger(__name__)

Out = Callable[[str], None]

_UPDATE_TIMEOUT_S = 120.0
_MAX_ERRORS_KEPT = 5
_SETTLE_S = 0.3
"""After the last answer: for the last commands to reach this process's tap."""
_DEFAULT_KEEP = 2


async def run_tenants(
    config: BenchConfig, run_dir: Path, out: Out, unmeasured: list[str]
) -> list[TenantResult]:
    """Every case of ``config.tenants``; what could not be measured goes to ``unmeasured``."""
    paths = await asyncio.to_thread(_write_adapters, run_dir, max(config.tenants.tenants))
    results: list[TenantResult] = []
    for n in config.tenants.sizes:
        fleet = _TenantFleet(config, n, run_dir, out, paths)
        try:
            results.extend(await fleet.run(unmeasured))
        except (BenchFailed, ChildFailed, ProcessGone) as exc:
            unmeasured.append(f"tenants N={n}: {exc}")
            out(f"tenants N={n}: failed: {exc}")
    return results


def _write_adapters(run_dir: Path, count: int) -> list[str]:
    """An adapter directory per tenant, each its own (absolute: agents take no other)."""
    root = run_dir.resolve() / "tenant-adapters"
    return [str(write_adapter(root, k + 1, base_model="sim-base")) for k in range(count)]


class _RoundTap:
    """Follows the fleet's commands: every distinct pause round since :meth:`clear`."""

    def __init__(self, nc: NatsClient, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self.rounds: set[frozenset[str]] = set()

    async def start(self) -> None:
        for subject in (self.subjects.cmd(), f"{self.subjects.cmd()}.*"):
            await self.nc.subscribe(subject, cb=self._on_command)
        await flushed(self.nc)

    async def _on_command(self, msg: Msg) -> None:
        try:
            command = command_decoder.decode(msg.data)
        except BadPayload:
            return
        if isinstance(command, PauseCommand):
            self.rounds.add(frozenset((command.update_id, *command.shared_with)))

    def clear(self) -> None:
        self.rounds = set()


@dataclass
class _Sample:
    """One update of one tenant."""

    tenant: str
    started: float
    ended: float
    committed: bool
    phases: dict[str, float] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class _Parts:
    """The processes of one mode, and the requester's side."""

    coordinator: Child
    hosts: list[Child]
    client: UpdateClient
    tap: _RoundTap


@dataclass
class _Counters:
    """What the window is measured against: CPU so far, its start, the machine."""

    cpu: dict[str, float]
    started: float
    foreign: ForeignLoad


class _TenantFleet(BenchFleet):
    """Every mode and tenant count at one fleet size."""

    def __init__(
        self, config: BenchConfig, n: int, run_dir: Path, out: Out, paths: list[str]
    ) -> None:
        super().__init__(
            config,
            "tenants",
            n,
            config.load_latency_s,
            config.load_jitter_s,
            run_dir.resolve() / f"tenants-n{n}",
        )
        self.plan = config.tenants
        self.out = out
        self.paths = paths
        self.keep = config.keep or _DEFAULT_KEEP
        self.versions: dict[str, int] = {}
        self.listing: ListingFrontend | None = None
        self.last_committed: UpdateResult | None = None

    async def run(self, unmeasured: list[str]) -> list[TenantResult]:
        results: list[TenantResult] = []
        async with NatsServer() as nats, self.children, ListingFrontend() as listing:
            self.nats, self.listing = nats, listing
            for mode in self.plan.modes:
                try:
                    results.extend(await self._mode(mode, unmeasured))
                except (BenchFailed, ChildFailed, ProcessGone) as exc:
                    unmeasured.append(f"tenants N={self.n} {mode}: {exc}")
                    self.out(f"tenants N={self.n} {mode}: failed: {exc}")
        return results

    async def _mode(self, mode: str, unmeasured: list[str]) -> list[TenantResult]:
        """Every tenant count of ``mode``, on one coordinator and one set of agents."""
        assert self.listing is not None
        fleet = f"bench-tenants-{mode}-n{self.n}"
        config = CoordinatorConfig(
            fleet=fleet,
            frontend_url=self.listing.url,
            expected_world_size=self.world_size,
            quorum_timeout_s=120,
            phase_timeout_s=60,
            verify_timeout_s=30,
            keep=self.keep,
            mode=UpdateMode(mode),
            max_concurrent=max(16, *self.plan.tenants),
            canary=self.config.canary,
        )
        coordinator = await self.children.lorabus(
            f"{fleet}-coordinator", coordinator_args(config, nats_url=self.nats_url)
        )
        hosts: list[Child] = []
        nc: NatsClient | None = None
        try:
            hosts = await self.start_hosts("agents", fleet, self.workers, self.plan.layout, "null")
            nc = await self.connect(Role.ORCHESTRATOR, name="bench-tenants")
            tap = _RoundTap(nc, Subjects(fleet=fleet))
            parts = _Parts(coordinator, hosts, UpdateClient(nc, fleet), tap)
            await self.wait_fleet_ready(parts.client, [coordinator, *hosts])
            await parts.tap.start()
            return await self._cases(parts, mode, unmeasured)
        finally:
            if nc is not None:
                await close(nc)
            # The coordinator first, so that no update is left half done.
            await self.children.stop(coordinator)
            await self.children.stop_all(hosts)

    async def _cases(self, parts: _Parts, mode: str, unmeasured: list[str]) -> list[TenantResult]:
        results: list[TenantResult] = []
        for tenants in sorted(self.plan.tenants):
            where = f"tenants N={self.n} {mode} T={tenants}"
            began = time.monotonic()
            try:
                result = await self._case(parts, mode, tenants)
            except BenchFailed as exc:
                unmeasured.append(f"{where}: {exc}")
                self.out(f"{where}: failed: {exc}")
                continue
            results.append(result)
            rounds = result.pauses_per_round
            self.out(
                f"{where}: {result.updates_per_s:.1f} updates/s, p99 "
                f"{(result.update_p99_s or 0) * 1000:.0f} ms, {result.failed} failed"
                + (f", {rounds:.3f} pauses/round" if rounds is not None else "")
                + f" ({time.monotonic() - began:.0f}s)"
            )
        return results

    async def _case(self, parts: _Parts, mode: str, tenants: int) -> TenantResult:
        """Warm-up, then every tenant's loop for the window; the figures."""
        names = [f"tenant-{k}" for k in range(tenants)]
        warm = await asyncio.gather(
            *(self._loop(parts.client, name, None, self.plan.warmup) for name in names)
        )
        if any(not s.committed for samples in warm for s in samples):
            log.warning("tenants N=%d %s T=%d: a warm-up update failed", self.n, mode, tenants)
        counters = await self._start_counting(parts)
        ends_at = counters.started + self.plan.seconds
        taken = await asyncio.gather(
            *(self._loop(parts.client, name, ends_at, None) for name in names)
        )
        await asyncio.sleep(_SETTLE_S)
        return await self._result(parts, mode, names, [s for t in taken for s in t], counters)

    async def _loop(
        self, client: UpdateClient, tenant: str, ends_at: float | None, count: int | None
    ) -> list[_Sample]:
        """``tenant``'s updates one after the other: ``count`` of them, or as many
        as start before ``ends_at`` (perf_counter)."""
        samples: list[_Sample] = []
        while (count is None or len(samples) < count) and (
            ends_at is None or time.perf_counter() < ends_at
        ):
            samples.append(await self._update(client, tenant))
        return samples

    async def _update(self, client: UpdateClient, tenant: str) -> _Sample:
        assert self.listing is not None
        version = self.versions[tenant] = self.versions.get(tenant, 0) + 1
        self.listing.announce_for(tenant, f"{tenant}-v{version}")
        path = self.paths[int(tenant.rsplit("-", 1)[1])]
        started = time.perf_counter()
        try:
            result = await client.update(tenant, path, version=version, timeout_s=_UPDATE_TIMEOUT_S)
        except LorabusError as exc:
            return _Sample(tenant, started, time.perf_counter(), False, error=f"{tenant}: {exc}")
        ended = time.perf_counter()
        if not result.committed:
            message = result.error.message if result.error else result.status
            return _Sample(tenant, started, ended, False, error=f"{tenant} v{version}: {message}")
        self.last_committed = result
        return _Sample(tenant, started, ended, True, phases=dict(result.phases))

    async def _start_counting(self, parts: _Parts) -> _Counters:
        """Engines' counts and the rounds start afresh; CPU as it stands."""
        await asyncio.gather(*(_ask_all(h, "times", "transitions") for h in parts.hosts))
        parts.tap.clear()
        foreign = self.foreign_load([parts.coordinator, *parts.hosts])
        return _Counters(cpu=self._cpu(parts), started=time.perf_counter(), foreign=foreign)

    def _cpu(self, parts: _Parts) -> dict[str, float]:
        assert self.nats is not None and self.nats.process is not None
        return {
            "coordinator": cpu_seconds(parts.coordinator.pid),
            "agents": cpu_of(parts.hosts),
            "nats": cpu_seconds(self.nats.process.pid),
            "requester": time.process_time(),
        }

    async def _result(
        self,
        parts: _Parts,
        mode: str,
        names: Sequence[str],
        samples: list[_Sample],
        counters: _Counters,
    ) -> TenantResult:
        window = self.plan.seconds
        cpu = self._cpu(parts)
        ends_at = counters.started + window
        done = [s for s in samples if s.committed]
        if not done:
            raise BenchFailed(f"no update committed: {[s.error for s in samples][:1]}")
        inside = [s for s in done if s.ended <= ends_at]
        walls = [s.ended - s.started for s in done]
        result = TenantResult(
            n=self.n,
            world_size=self.world_size,
            mode=mode,
            tenants=len(names),
            window_s=window,
            layout=self.plan.layout,
            load_latency_s=self.latency,
            keep=self.keep,
            committed=len(inside),
            failed=sum(not s.committed for s in samples),
            drained=len(done) - len(inside),
            updates_per_s=round(len(inside) / window, 3),
            per_tenant_committed=[sum(s.tenant == t for s in inside) for t in names],
            update_s=stats_of(walls),
            update_p99_s=round(percentile(walls, 99), 6),
            phases_s=_phases(done),
            cpu_cores={k: round((cpu[k] - counters.cpu[k]) / window, 3) for k in cpu},
            foreign_load=counters.foreign.share(),
            result_bytes=len(encode(self.last_committed)) if self.last_committed else None,
            errors=[s.error for s in samples if not s.committed][:_MAX_ERRORS_KEPT],
        )
        if mode == PAUSE:
            await self._pauses(parts, result)
        return result

    async def _pauses(self, parts: _Parts, result: TenantResult) -> None:
        """Pause mode: the rounds, and how often each engine paused in them."""
        asked = await asyncio.gather(*(_ask_all(h, "transitions", "times") for h in parts.hosts))
        per_worker: dict[str, int] = {}
        for transitions, _ in asked:
            per_worker.update(transitions["transitions"])
        engines = [times for _, times in asked]
        counts = [per_worker.get(wid, 0) for wid in self.workers]
        rounds = parts.tap.rounds
        result.rounds = len(rounds)
        result.pause_transitions_per_worker = stats_of([float(c) for c in counts])
        result.engine_pause_calls_per_worker = sum(e["pauses"] for e in engines) / self.n
        if rounds:
            result.updates_per_round = round(sum(len(r) for r in rounds) / len(rounds), 3)
            result.pauses_per_round = round(sum(counts) / self.n / len(rounds), 4)


def _phases(done: Sequence[_Sample]) -> dict[str, Stats]:
    """The committed updates' phases, and ``other``: their time outside them."""
    phases: dict[str, list[float]] = {"other": []}
    for sample in done:
        for name, seconds in sample.phases.items():
            phases.setdefault(name, []).append(seconds)
        phases["other"].append(sample.ended - sample.started - sum(sample.phases.values()))
    return {name: stats_of(values) for name, values in phases.items()}


async def _ask_all(host: Child, *ops: str) -> list[dict[str, Any]]:
    """``host``'s answers to ``ops``, one after the other (one line answers one ask)."""
    return [await host.ask(op) for op in ops]
