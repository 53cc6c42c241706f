"""``lorabus bench --series placement``: more adapters than any engine holds.

For each fleet size N: a nats-server, a listing frontend, the real ``lorabus
coordinator`` in live mode (``--keep K``, ``--replace-after`` short) and N
agents with null engines in the agent host processes, each engine holding at
most C adapters (``--max-adapters C``), with T x K above C. T tenants
(``tenant-0`` ..) each update their own adapter, all at once, ``rounds``
times, every update placed on R workers (:meth:`PlacementCase.replicas_for`:
as many as the capacity allows). Then one worker is stopped, as a kill would
(its agent's connection closes), and the bench waits until no adapter is
placed on it; then every tenant updates ``rounds`` times again.

What it checks, each from what the system itself says:

- **capacity**: the most adapters any engine held at once, from the null
  engines' own lists (their peaks, asked of the agent hosts), at most C;
- **spread**: the adapters placed per worker, from ``lorabus status``,
  within one of even;
- **moves**: stopping one worker moved only the adapters placed on it, each
  to one other worker, and no other adapter's placement changed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

from lorabus.bus.connect import close
from lorabus.client import UpdateClient
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.errors import LorabusError
from lorabus.schemas import FleetStatus, UpdateMode
from lorabus.security.roles import Role
from lorabus.service_flags import coordinator_args
from lorabus.testbed.bench.children import Child, ChildFailed
from lorabus.testbed.bench.config import BenchConfig
from lorabus.testbed.bench.fleet import BenchFailed, BenchFleet
from lorabus.testbed.bench.frontend import ListingFrontend
from lorabus.testbed.bench.placementreport import PlacementResult
from lorabus.testbed.bench.procinfo import ProcessGone
from lorabus.testbed.natsserver import NatsServer
from lorabus.testbed.trainer import write_adapter

log = logging.getLogger(__name__)

Out = Callable[[str], None]

_UPDATE_TIMEOUT_S = 120.0
_REPLACE_AFTER_S = 3.0
"""The coordinator's ``--replace-after``: a stopped worker is noticed soon."""
_MOVE_DEADLINE_S = 120.0
_MAX_ERRORS_KEPT = 5


async def run_placement(
    config: BenchConfig, run_dir: Path, out: Out, unmeasured: list[str]
) -> list[PlacementResult]:
    """Every fleet size of ``config.placement``; what could not be measured goes
    to ``unmeasured``."""
    paths = await asyncio.to_thread(_write_adapters, run_dir)
    results: list[PlacementResult] = []
    for n in config.placement.sizes:
        fleet = _PlacementFleet(config, n, run_dir, out, paths)
        try:
            results.append(await fleet.run())
        except (BenchFailed, ChildFailed, ProcessGone) as exc:
            unmeasured.append(f"placement N={n}: {exc}")
            out(f"placement N={n}: failed: {exc}")
    return results


def _write_adapters(run_dir: Path) -> list[str]:
    """Two adapter directories, which the tenants' versions take in turn."""
    root = run_dir.resolve() / "placement-adapters"
    return [str(write_adapter(root, k + 1, base_model="sim-base")) for k in range(2)]


class _PlacementFleet(BenchFleet):
    def __init__(
        self, config: BenchConfig, n: int, run_dir: Path, out: Out, paths: list[str]
    ) -> None:
        super().__init__(
            config,
            "placement",
            n,
            config.load_latency_s,
            config.load_jitter_s,
            run_dir.resolve() / f"placement-n{n}",
        )
        self.plan = config.placement
        self.replicas = self.plan.replicas_for(n)
        self.out = out
        self.paths = paths
        self.versions: Counter[str] = Counter()
        self.errors: list[str] = []
        self.committed = 0
        self.listing: ListingFrontend | None = None

    async def run(self) -> PlacementResult:
        async with NatsServer() as nats, self.children, ListingFrontend() as listing:
            self.nats, self.listing = nats, listing
            fleet = f"bench-placement-n{self.n}"
            config = CoordinatorConfig(
                fleet=fleet,
                frontend_url=listing.url,
                expected_world_size=self.world_size,
                quorum_timeout_s=60,
                phase_timeout_s=60,
                verify_timeout_s=30,
                keep=self.plan.keep,
                mode=UpdateMode.LIVE,
                max_concurrent=max(16, self.plan.tenants),
                canary=self.config.canary,
                replace_after_s=_REPLACE_AFTER_S,
            )
            coordinator = await self.children.lorabus(
                f"{fleet}-coordinator", coordinator_args(config, nats_url=self.nats_url)
            )
            hosts = await self.start_hosts(
                "agents", fleet, self.workers, "own", "null", max_adapters=self.plan.capacity
            )
            nc = await self.connect(Role.ORCHESTRATOR, name="bench-placement")
            try:
                client = UpdateClient(nc, fleet)
                await self.wait_fleet_ready(client, [coordinator, *hosts])
                return await self._measure(client, hosts)
            finally:
                await close(nc)
                await self.children.stop(coordinator)
                await self.children.stop_all(hosts)

    async def _measure(self, client: UpdateClient, hosts: list[Child]) -> PlacementResult:
        tenants = [f"tenant-{k}" for k in range(self.plan.tenants)]
        began = time.monotonic()
        await self._rounds(client, tenants)
        before = _placed(await client.status(timeout_s=30))
        spread = _spread(before, self.workers)
        gone = max(self.workers, key=lambda w: (sum(w in ws for ws in before.values()), w))
        on_it = sorted(a for a, ws in before.items() if gone in ws)
        stopped_at = time.monotonic()
        host = hosts[list(self.workers).index(gone) % len(hosts)]
        await host.ask("stop_agent", worker=gone)
        after = await self._moved_off(client, gone)
        replace_s = time.monotonic() - stopped_at
        await self._rounds(client, tenants)
        peaks = await _peaks(hosts)
        result = PlacementResult(
            n=self.n,
            tenants=self.plan.tenants,
            keep=self.plan.keep,
            capacity=self.plan.capacity,
            replicas=self.replicas,
            rounds=self.plan.rounds,
            committed=self.committed,
            failed=len(self.errors),
            peak_held=max(peaks.values(), default=0),
            adapters_per_worker_min=min(spread.values()),
            adapters_per_worker_max=max(spread.values()),
            stopped=gone,
            adapters_on_stopped=len(on_it),
            moved=sorted(a for a in before if after.get(a) != before[a]),
            moved_only_its_own=_moved_only(before, after, gone),
            replace_s=round(replace_s, 2),
            elapsed_s=round(time.monotonic() - began, 1),
            errors=self.errors[:_MAX_ERRORS_KEPT],
        )
        self.out(
            f"placement N={self.n} T={result.tenants} C={result.capacity} R={result.replicas}: "
            f"{result.committed} committed, {result.failed} failed, peak {result.peak_held} "
            f"held, {result.adapters_per_worker_min}-{result.adapters_per_worker_max} "
            f"adapters per worker, stopping {gone} moved {len(result.moved)} of its "
            f"{len(on_it)} in {replace_s:.1f}s"
        )
        return result

    async def _rounds(self, client: UpdateClient, tenants: list[str]) -> None:
        for _ in range(self.plan.rounds):
            await asyncio.gather(*(self._update(client, t) for t in tenants))

    async def _update(self, client: UpdateClient, tenant: str) -> None:
        assert self.listing is not None
        self.versions[tenant] += 1
        version = self.versions[tenant]
        self.listing.announce_for(tenant, f"{tenant}-v{version}")
        try:
            result = await client.update(
                tenant,
                self.paths[version % len(self.paths)],
                version=version,
                replicas=self.replicas,
                timeout_s=_UPDATE_TIMEOUT_S,
            )
        except LorabusError as exc:
            self.errors.append(f"{tenant} v{version}: {exc}")
            return
        if result.committed:
            self.committed += 1
        else:
            self.errors.append(f"{tenant} v{version}: {result.error}")

    async def _moved_off(self, client: UpdateClient, gone: str) -> dict[str, list[str]]:
        """The placements once none names ``gone`` any more."""
        deadline = time.monotonic() + _MOVE_DEADLINE_S
        while time.monotonic() < deadline:
            placed = _placed(await client.status(timeout_s=30))
            if not any(gone in workers for workers in placed.values()):
                return placed
            await asyncio.sleep(0.5)
        raise BenchFailed(f"adapters still placed on {gone} {_MOVE_DEADLINE_S:.0f}s after its stop")


def _placed(status: FleetStatus) -> dict[str, list[str]]:
    if "holders" in status.trimmed:
        raise BenchFailed("the status left out where adapters are placed (message size limit)")
    return {a.adapter: list(a.placed) for a in status.adapters}


def _spread(placed: Mapping[str, list[str]], workers: Mapping[str, int]) -> dict[str, int]:
    """Adapters placed per worker, every worker counted (0 where none)."""
    counts = Counter(w for ws in placed.values() for w in ws)
    return {w: counts.get(w, 0) for w in workers}


def _moved_only(before: Mapping[str, list[str]], after: Mapping[str, list[str]], gone: str) -> bool:
    """Whether only the adapters on ``gone`` moved, each to one other worker in
    its place, the rest of its workers kept."""
    for adapter, workers in before.items():
        now = after.get(adapter, [])
        if gone not in workers:
            if now != workers:
                return False
            continue
        kept = set(workers) - {gone}
        if not kept <= set(now) or len(now) != len(workers) or gone in now:
            return False
    return True


async def _peaks(hosts: list[Child]) -> dict[str, int]:
    peaks: dict[str, int] = {}
    for answer in await asyncio.gather(*(host.ask("peaks") for host in hosts)):
        peaks.update(answer["peaks"])
    return peaks
