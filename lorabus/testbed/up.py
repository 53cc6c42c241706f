"""``lorabus up``: the whole system on one machine, driven by a demo trainer.

Starts a private nats-server, a simulated Dynamo fleet with mixed world sizes,
one agent per worker and the coordinator; then a small trainer writes a real
PEFT adapter per step and asks for each to be served, as an RL orchestrator
would. With several tenants, as many trainers do so at once, each for its
own adapter (``tenant-1``, ...): their updates run concurrently, and those
queued together share one pause of the fleet. It ends by reading back the
run's audit trail and printing the verdict of ``audit verify`` as its last
line. Everything it started is stopped when it ends, also on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from lorabus.audit.render import phase_timeline, rank_map_text
from lorabus.audit.tap import Tap
from lorabus.audit.timeline import build_timelines
from lorabus.audit.timeline_page import render_page
from lorabus.audit.verify import TrailRecord, verify
from lorabus.bus.connect import close
from lorabus.runtime.cancellation import raise_if_cancelled
from lorabus.schemas import Subjects, UpdateResult
from lorabus.security.roles import Role
from lorabus.simfleet import SimWorker
from lorabus.testbed.stack import EmbeddedStack
from lorabus.testbed.trainer import write_adapter

ADAPTER = "policy"
"""The adapter of a run with one tenant; with more, ``tenant-<n>``."""
KEEP = 2
"""Versions each engine keeps; older ones are retired after each commit."""
RETIRE_DEADLINE_S = 10.0


async def run_up(
    steps: int,
    world_sizes: Sequence[int],
    out: Callable[[str], None],
    *,
    timeline_path: str | None = None,
    tenants: int = 1,
) -> bool:
    """Run the demo; True when every step of every tenant committed. With
    ``timeline_path``, draw its updates there (``lorabus audit timeline``'s page)."""
    started = time.monotonic()
    adapters = [ADAPTER] if tenants == 1 else [f"tenant-{n}" for n in range(1, tenants + 1)]
    with tempfile.TemporaryDirectory(prefix="lorabus-adapters-") as tmp:
        out(
            f"starting nats-server (TLS, an identity per part), {len(world_sizes)} "
            "simulated Dynamo workers "
            f"(world sizes {', '.join(map(str, world_sizes))}), their agents and the coordinator"
        )
        nodes = Path(tmp, "nodes")
        out(
            "adapters travel over the bus: each trainer pushes each step's adapter to the "
            "fleet's object store, and each agent fetches it into a cache of its own "
            f"(as on separate nodes) under {nodes}"
        )
        if tenants > 1:
            out(f"{tenants} trainers update {', '.join(adapters)} at once")
        async with EmbeddedStack(
            world_sizes, fleet="demo", keep=KEEP, secure=True, cache_root=str(nodes)
        ) as stack:
            assert stack.client is not None and stack.sim is not None
            out(f"  nats {stack.nats_url}   frontend {stack.sim.url}")
            runs = await asyncio.gather(
                *(
                    _train(stack, adapter, Path(tmp, adapter), steps, seed, out, tenants > 1)
                    for seed, adapter in enumerate(adapters)
                )
            )
            results = [result for run in runs for result in run]
            last = next((r for r in reversed(results) if r.rank_map is not None), None)
            if last is not None and last.rank_map is not None:
                out(rank_map_text(last.rank_map))
            await _retired(stack, adapters)
            serving = sorted({a for w in stack.sim.workers.values() for a in w.adapters})
            paused = sorted(w.worker_id for w in stack.sim.workers.values() if w.paused)
            trail = await _record_trail(stack)
        committed = sum(r.committed for r in results)
        out(
            f"summary: {committed}/{len(results)} updates committed; engines now serve "
            f"{', '.join(serving) or 'nothing'}; paused engines: {', '.join(paused) or 'none'}; "
            f"{time.monotonic() - started:.1f}s in all"
        )
        violations = verify(trail)
        for violation in violations:
            out(f"  {violation.rule}: {violation.message} (records {violation.seqs})")
        out(f"audit: {len(trail)} records, {len(violations)} violation(s)")
        if timeline_path is not None:
            timelines = build_timelines(trail)
            await asyncio.to_thread(Path(timeline_path).write_text, render_page(timelines))
            out(f"timeline: {len(timelines)} update(s) drawn in {timeline_path}")
    return committed == len(results) and not violations


async def _train(
    stack: EmbeddedStack,
    adapter: str,
    root: Path,
    steps: int,
    seed: int,
    out: Callable[[str], None],
    named: bool,
) -> list[UpdateResult]:
    """One trainer: a step's adapter written, then served, step after step;
    ``named``: its lines say which adapter (several trainers print at once)."""
    assert stack.client is not None
    results: list[UpdateResult] = []
    who = f"{adapter} " if named else ""
    for step in range(1, steps + 1):
        # Each step now pushes over nats-py's wait_for, which in Python
        # 3.11 can drop a Ctrl-C's cancellation (lorabus/runtime/cancellation.py).
        raise_if_cancelled()
        path = await asyncio.to_thread(write_adapter, root, step, seed=seed * 1000)
        result = await stack.client.update(adapter, source=path, version=step, timeout_s=120)
        results.append(result)
        out(
            f"{who}step {step}: {result.status:<9} {result.adapter:<12} "
            f"{sum(result.phases.values()) * 1000:6.0f}ms  [{phase_timeline(result)}]"
        )
        if result.error is not None:
            out(f"  {who}error [{result.error.code}]: {result.error.message}")
    return results


async def _retired(stack: EmbeddedStack, adapters: Sequence[str]) -> None:
    """Agents retire old versions after the update is answered: give them the
    moment that takes, so the summary shows what the fleet settles on."""
    assert stack.sim is not None
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(RETIRE_DEADLINE_S):
            for worker in stack.sim.workers.values():
                await worker.wait_until(functools.partial(_settled, worker, adapters))


def _settled(worker: SimWorker, adapters: Sequence[str]) -> bool:
    return all(
        sum(name.startswith(f"{adapter}-v") for name in worker.adapters) <= KEEP
        for adapter in adapters
    )


async def _record_trail(stack: EmbeddedStack) -> list[TrailRecord]:
    """The run's audit trail, read back from the fleet's audit stream."""
    records: list[TrailRecord] = []

    async def keep(record: TrailRecord) -> None:
        records.append(record)

    nc = await stack.bus_as(Role.AUDITOR).connect("lorabus-auditor")
    try:
        await Tap(nc, Subjects(fleet=stack.fleet_name)).run(keep, follow=False)
    finally:
        await close(nc)
    return records
