"""The trainers of a chaos run: one update loop per tenant, each on its own adapter.

With ``tenants`` 1 the run has one trainer, on adapter ``policy``, exactly as
before tenants. With more, tenant ``i`` trains ``tenant-<i>``: its own step
adapters (bytes of its own, under ``adapters/tenant-<i>``; pushed to the
store with its own seeded reuse and orphans), its own versions and update
ids, and its own loop, all at once and under the same fault schedule. The
first tenant's loop decides the quiet windows every loop waits for
(:mod:`lorabus.testbed.chaos.quiet`). The frozen-leader fault's one-call
requests go to the tenants in turn. After the faults are healed each tenant
asks for its own recovery update, all at once.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path

from lorabus.client import UpdateClient
from lorabus.testbed.chaos.adapters import StepAdapters
from lorabus.testbed.chaos.config import ChaosConfig
from lorabus.testbed.chaos.quiet import QuietWindows
from lorabus.testbed.chaos.timeline import Timeline, UpdateRecord
from lorabus.testbed.chaos.updates import UpdateLoop


class Tenants:
    def __init__(self, loops: list[UpdateLoop], quiet: QuietWindows | None) -> None:
        self.loops = loops
        self.quiet = quiet
        self._by_adapter = {loop.adapter: loop for loop in loops}
        self._turns = itertools.cycle(loops)

    @classmethod
    def start(
        cls,
        config: ChaosConfig,
        client: UpdateClient,
        timeline: Timeline,
        adapters_root: Path,
        *,
        run_id: str,
        idle_s: float,
        out: Callable[[str], None],
    ) -> Tenants:
        names = config.adapter_names()
        several = len(names) > 1
        quiet = QuietWindows() if several else None
        loops = []
        for index, adapter in enumerate(names):
            steps = StepAdapters(
                client,
                timeline,
                adapters_root / adapter if several else adapters_root,
                by_bus=config.by_bus,
                seed=config.seed,
                reuse_chance=config.reuse_chance,
                orphan_chance=config.orphan_chance,
                tenant=index,
            )
            loops.append(
                UpdateLoop(
                    client,
                    timeline,
                    steps,
                    seed=config.seed,
                    run_id=f"{run_id}-{adapter}" if several else run_id,
                    attempt_timeout_s=config.attempt_timeout_s,
                    retry_bound_s=config.retry_bound_s,
                    idle_chance=config.idle_chance,
                    idle_s=idle_s,
                    out=out,
                    adapter=adapter,
                    tenant=index,
                    quiet=quiet,
                )
            )
        return cls(loops, quiet)

    async def run_until(self, deadline: float, also: asyncio.Task[None] | None = None) -> None:
        """Every loop, until ``deadline`` has passed and ``also`` is done."""
        await asyncio.gather(*(loop.run_until(deadline, also) for loop in self.loops))

    async def request_once(self, timeout_s: float, *, frozen_leader: str) -> UpdateRecord | None:
        """One client call for the next tenant in turn's next version."""
        return await next(self._turns).request_once(timeout_s, frozen_leader=frozen_leader)

    async def recover(self, attempts: int) -> None:
        """Each tenant asks for an update until one commits, up to ``attempts``."""

        async def recover(loop: UpdateLoop) -> None:
            for _ in range(attempts):
                record = await loop.run_step(recovery=True)
                if record.result is not None and record.result.committed:
                    return

        await asyncio.gather(*(recover(loop) for loop in self.loops))

    async def ask_again(self, records: list[UpdateRecord]) -> None:
        """Ask once more for each finished update's id, through its tenant's loop."""
        for record in records:
            loop = self._by_adapter.get(record.adapter)
            if loop is not None:
                await loop.ask_again(record)
