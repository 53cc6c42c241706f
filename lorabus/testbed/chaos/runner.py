"""``lorabus chaos``: updates in a loop while a seeded schedule breaks the fleet.

The run, in order: start NATS and the simulated engines, start listening
(engines and bus), start the coordinators and agents, wait until the fleet is
ready, start sampling the adapter store (by bus); then for ``duration_s`` (or
until ``faults`` faults have been injected) run each tenant's update loop
while the injector applies the schedule; then heal every fault, ask for a
recovery update of each tenant's adapter, let the engines converge, ask
again for every update id, stop sampling, and judge the timeline.
Every process is stopped on the way out, also on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import nats.errors

from lorabus.bus.connect import close, connect
from lorabus.client import UpdateClient
from lorabus.coordinator.config import StorageConfig
from lorabus.coordinator.store import FleetStore
from lorabus.errors import NoCoordinator
from lorabus.schemas import Subjects
from lorabus.testbed.chaos.commits import last_committed
from lorabus.testbed.chaos.config import ChaosConfig
from lorabus.testbed.chaos.fleet import ChaosFleet
from lorabus.testbed.chaos.inject import FaultInjector
from lorabus.testbed.chaos.invariants import check_all
from lorabus.testbed.chaos.observe import BusObserver, EngineWatcher
from lorabus.testbed.chaos.report import ChaosReport, build_report
from lorabus.testbed.chaos.schedule import Fault, build_schedule
from lorabus.testbed.chaos.store_watch import StoreWatcher
from lorabus.testbed.chaos.tenants import Tenants
from lorabus.testbed.chaos.timeline import Timeline, now

log = logging.getLogger(__name__)

_RECOVERY_ATTEMPTS = 3


def _spare(faults: int) -> int:
    """Faults scheduled beyond ``faults``, for those skipped (no leader found)."""
    return max(10, faults // 10)


async def run_chaos(config: ChaosConfig, out: Callable[[str], None] = print) -> ChaosReport:
    """Run the chaos described by ``config``; return its report (violations included)."""
    started = now()
    run_dir = config.run_dir or Path(tempfile.mkdtemp(prefix="lorabus-chaos-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = config.fleet_settings()
    timeline = Timeline()
    worker_ids = [f"w{i:03d}" for i in range(len(config.world_sizes))]
    schedule, run_s = _schedule(config, worker_ids)
    planned = (
        f"{len(schedule)} faults scheduled"
        if config.faults is None
        else f"until {config.faults} faults have been injected (about {run_s:.0f}s)"
    )
    tenants = (
        f", {config.tenants} tenants ({', '.join(config.adapter_names())})"
        if config.tenants > 1
        else ""
    )
    out(
        f"chaos: seed {config.seed}, {run_s:.0f}s, {len(worker_ids)} workers "
        f"(world sizes {', '.join(map(str, config.world_sizes))}), {planned}, "
        f"fault gap {config.mean_gap_s:g}s{tenants}; run dir {run_dir}"
    )
    async with ChaosFleet(settings, run_dir, timeline, out) as fleet:
        injector = await _run(config, fleet, timeline, schedule, run_s, run_dir, out)
    violations = check_all(timeline, config.bounds())
    (run_dir / "timeline.json").write_bytes(
        msgspec.json.format(msgspec.json.encode(timeline.dump()), indent=1)
    )
    report = build_report(
        seed=config.seed,
        duration_s=run_s,
        elapsed_s=now() - started,
        settings={
            **dataclasses.asdict(settings),
            "grace_s": config.bounds().grace_s,
            "converge_s": config.converge_s,
            "mean_gap_s": config.mean_gap_s,
            "idle_chance": config.idle_chance,
            "faults": config.faults,
            "one_call_timeout_s": config.one_call_timeout_s(),
            "adapters": config.adapters,
            "reuse_chance": config.reuse_chance,
            "orphan_chance": config.orphan_chance,
            "store_sample_s": config.store_sample_s,
            "tenants": config.tenants,
        },
        timeline=timeline,
        schedule=schedule,
        injected=injector.injected,
        skipped=injector.skipped,
        violations=violations,
        run_dir=str(run_dir),
    )
    if config.run_dir is None and report.ok:
        shutil.rmtree(run_dir, ignore_errors=True)
    return report


def _schedule(config: ChaosConfig, worker_ids: list[str]) -> tuple[list[Fault], float]:
    """The run's faults, and how long it runs: ``duration_s``, or with ``faults``
    until the last of those is due (the run goes on until they have all landed)."""
    if config.faults is None:
        horizon, count = config.duration_s, None
    else:
        horizon, count = math.inf, config.faults + _spare(config.faults)
    schedule = build_schedule(
        config.seed,
        horizon,
        worker_ids,
        mean_gap_s=config.mean_gap_s,
        kinds=config.fault_kinds(),
        count=count,
    )
    if config.faults is None or not schedule:
        return schedule, config.duration_s
    if not schedule:
        return schedule, config.duration_s
    return schedule, schedule[min(config.faults, len(schedule)) - 1].at_s


async def _run(
    config: ChaosConfig,
    fleet: ChaosFleet,
    timeline: Timeline,
    schedule: list[Fault],
    run_s: float,
    run_dir: Path,
    out: Callable[[str], None],
) -> FaultInjector:
    settings = fleet.settings
    bounds = config.bounds()
    nc = await connect(fleet.nats_url, name="lorabus-chaos")
    observer = BusObserver(Subjects(fleet=settings.fleet), timeline)
    watcher = asyncio.create_task(EngineWatcher(fleet.sim, timeline).run(), name="engine-watcher")
    client = UpdateClient(nc, settings.fleet)
    tenants = Tenants.start(
        config,
        client,
        timeline,
        run_dir / "adapters",
        run_id=f"chaos{config.seed}-{uuid.uuid4().hex[:6]}",
        idle_s=bounds.pause_lease_s + bounds.grace_s + 2.0,
        out=out,
    )
    one_call_timeout_s = config.one_call_timeout_s()

    async def request_once(frozen_leader: str) -> object:
        return await tenants.request_once(one_call_timeout_s, frozen_leader=frozen_leader)

    injector = FaultInjector(
        fleet, schedule, client, out, request_once=request_once, stop_after=config.faults
    )
    sampling: asyncio.Task[None] | None = None
    try:
        await observer.start(nc)
        await fleet.start_services()
        if not await fleet.wait_ready(client):
            crashes = "\n".join(timeline.crashes)
            raise RuntimeError(
                f"the fleet did not become ready within 30s; logs in {run_dir / 'logs'}\n{crashes}"
            )
        store_watcher = await _store_watcher(config, fleet, client, timeline)
        began = timeline.origin = now()
        if store_watcher is not None:
            sampling = asyncio.create_task(store_watcher.run(), name="store-watcher")
        injecting = asyncio.create_task(injector.run(began), name="injector")
        try:
            # Until the run's time is up and every scheduled fault has landed.
            await tenants.run_until(began + run_s, also=injecting)
            await injecting
        finally:
            injecting.cancel()
            await asyncio.gather(injecting, return_exceptions=True)
        out(f"heal   every fault ({len(fleet.open_faults)} still holding)")
        await injector.heal()
        timeline.healed_at = now()
        await fleet.wait_ready(client, deadline_s=bounds.converge_s + 10.0)
        await tenants.recover(_RECOVERY_ATTEMPTS)
        await _wait_settled(fleet, timeline, bounds.converge_s)
        timeline.final_committed, timeline.final_adapters = await _committed(client)
        await tenants.ask_again(list(timeline.updates))
        await _wait_settled(fleet, timeline, bounds.pause_lease_s + bounds.grace_s)
        timeline.ended_at = now()
        if sampling is not None and sampling.done():
            sampling.result()  # raises what stopped the sampling before its time
    finally:
        await injector.aclose()
        tasks = [t for t in (watcher, sampling) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await observer.stop()
        await close(nc)
    return injector


async def _store_watcher(
    config: ChaosConfig, fleet: ChaosFleet, client: UpdateClient, timeline: Timeline
) -> StoreWatcher | None:
    """By bus, what samples the adapter store against the fleet's records (read
    as the coordinators read them, from the run's own connection)."""
    if not config.by_bus:
        return None
    storage = StorageConfig(fleet=fleet.settings.fleet, kv_replicas=len(fleet.nodes))
    records = await FleetStore.open(client.nc, storage)
    return StoreWatcher(
        client.nc, client.subjects, records, timeline, every_s=config.store_sample_s
    )


async def _wait_settled(fleet: ChaosFleet, timeline: Timeline, deadline_s: float) -> None:
    """Poll until no engine is paused and every one lists each adapter's last
    commit (or the deadline)."""
    names = {u.result.adapter for u in last_committed(timeline).values() if u.result is not None}
    deadline = now() + deadline_s
    while now() < deadline:
        workers = fleet.sim.workers.values()
        if not any(w.paused for w in workers) and all(names <= set(w.adapters) for w in workers):
            return
        await asyncio.sleep(0.05)


async def _committed(client: UpdateClient) -> tuple[str | None, dict[str, str] | None]:
    """What the leader reports as committed: the latest commit ("(none)") and
    each adapter's served name; Nones if nobody answers."""
    with contextlib.suppress(NoCoordinator, nats.errors.Error):
        status = await client.status(timeout_s=5.0)
        return status.committed_adapter or "(none)", {
            a.adapter: a.served_name for a in status.adapters
        }
    return None, None
