"""What each step of a chaos run asks for: a directory, or an adapter in the store.

By ``path``, each step's adapter is written under the run's adapter root and
named by its directory; the newest few directories are kept, and always the
committed one (a restarted engine reloads it from there).

By ``bus`` (the default), the run is an orchestrator as ``lorabus up``'s
trainer is: each step's adapter is written, pushed to the fleet's object
store (nothing is sent when the store holds its digest already) and named by
its digest; the directory goes once pushed, since agents fetch from the
store into caches of their own. So that the leader's deletions are
exercised, a seeded share of steps push the bytes of an earlier step or
orphan again for their new version (the same digest, deleted since or not),
and a share also push an adapter nobody asks for (an orphan, for the sweep).
A push that fails on the bus (nats-server restarting, say) is tried again
until the step's retry bound; an orphan's is tried once. Every push is
written into the timeline. With several tenants, each has its own: its
steps' and orphans' bytes differ from every other tenant's.
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lorabus.adapters.bus_paths import bus_path
from lorabus.adapters.store import push_adapter
from lorabus.client import UpdateClient
from lorabus.errors import BusError
from lorabus.testbed.chaos.timeline import Push, Timeline, now
from lorabus.testbed.trainer import write_adapter

log = logging.getLogger(__name__)

_KEEP_ADAPTER_DIRS = 8
_RETRY_PAUSE_S = 0.2
_PUSH_TIMEOUT_S = 10.0
"""For one push of a small adapter: past it, the bus is taken to be down."""
_ORPHAN_SEED = 1_000_003
"""Seeds an orphan's tensors (``write_adapter`` seeds with seed + step): no
step's adapter has the same bytes."""
_TENANT_SEED = 100_000_007
"""Apart, per tenant, the seeds of its steps' and orphans' tensors: each
trainer's adapters have bytes of their own."""


@dataclass(frozen=True)
class _Content:
    """Which bytes: ``write_adapter(..., step, seed=seed)`` writes the same ones each time."""

    step: int
    seed: int = 0


class StepAdapters:
    def __init__(
        self,
        client: UpdateClient,
        timeline: Timeline,
        root: Path,
        *,
        by_bus: bool,
        seed: int,
        reuse_chance: float,
        orphan_chance: float,
        tenant: int = 0,
    ) -> None:
        """``tenant``: the trainer's index (0: as a run with one trainer), which
        seeds what it pushes and the bytes it writes."""
        self.client = client
        self.timeline = timeline
        self.root = root
        self.by_bus = by_bus
        self.reuse_chance = reuse_chance
        self.orphan_chance = orphan_chance
        self.committed_version = 0
        """The newest version committed (by ``path``, its directory is kept)."""
        self._pushed: list[_Content] = []
        """Every content pushed so far, which a later step may push again."""
        self._seed = tenant * _TENANT_SEED
        self._rng = random.Random(
            f"{seed}-adapters" if tenant == 0 else f"{seed}-adapters-{tenant}"
        )

    async def prepare(
        self, step: int, *, give_up_at: float, variety: bool = True
    ) -> tuple[str | None, str]:
        """Write (and by bus push) step ``step``'s adapter: what its request
        names, or None when its push failed until ``give_up_at``; and why.
        ``variety``: a step may push earlier bytes again, and an orphan."""
        if not self.by_bus:
            path = str(write_adapter(self.root, step, seed=self._seed))
            self._prune(step)
            return path, ""
        content, kind = _Content(step, self._seed), "new"
        if variety and self._pushed and self._rng.random() < self.reuse_chance:
            content, kind = self._rng.choice(self._pushed), "again"
        orphan = variety and self._rng.random() < self.orphan_chance
        digest, why = await self._push(content, kind, give_up_at)
        if digest is None:
            return None, why
        if orphan:
            await self._push(_Content(step, self._seed + _ORPHAN_SEED), "orphan", now())
        return bus_path(digest), ""

    async def _push(
        self, content: _Content, kind: str, give_up_at: float
    ) -> tuple[str | None, str]:
        """Push ``content``, again after a pause until ``give_up_at``: its
        digest, or None and the last error."""
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.root, prefix="push-") as scratch:
            directory = write_adapter(Path(scratch), content.step, seed=content.seed)
            while True:
                try:
                    digest, uploaded = await push_adapter(
                        self.client.nc, self.client.subjects, directory, timeout_s=_PUSH_TIMEOUT_S
                    )
                except BusError as exc:
                    log.info("push of %s (step %d) failed: %s", kind, content.step, exc)
                    if now() >= give_up_at:
                        return None, str(exc)
                    await asyncio.sleep(_RETRY_PAUSE_S)
                    continue
                self.timeline.pushes.append(Push(now(), digest, kind, uploaded))
                if content not in self._pushed:
                    self._pushed.append(content)
                return digest, ""

    def _prune(self, step: int) -> None:
        """Keep the newest few adapter directories (a long run writes hundreds), and
        always the committed one: a restarted engine reloads it from there."""
        for directory in self.root.glob("step_*"):
            version = int(directory.name.removeprefix("step_"))
            if version < min(step - _KEEP_ADAPTER_DIRS, self.committed_version):
                shutil.rmtree(directory, ignore_errors=True)
