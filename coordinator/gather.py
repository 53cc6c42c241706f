"""Gathering the acks of one phase from a known set of members.

The bus callback hands every ack to :class:`AckRouter`, which passes it to the
gather waiting for that (update, phase); acks for anything else (late, repeated,
from non-members, of another term's command) are dropped there. The epoch
matters when an update id runs again in a later term: a ``fenced`` ack that an
agent sends to a command of an earlier term (replayed, or late) must not count
for the new one. Completion is a single event, so 1000 acks
cost 1000 dict look-ups and one wake-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from lorabus.schemas import Ack, Phase, acks_in


class PhaseGather:
    def __init__(
        self,
        update_id: str,
        phase: Phase,
        members: Iterable[str],
        first_ok: asyncio.Event | None = None,
        epoch: int = 0,
    ) -> None:
        self.update_id = update_id
        self.phase = phase
        self.epoch = epoch
        """The term whose commands these acks answer (0: any, for tests)."""
        self.acks: dict[str, Ack] = {}
        self.waiting: set[str] = set(members)
        self.lost: set[str] = set()
        self.first_ok = first_ok
        """Set at the first ok ack, for work that may start once one member succeeded."""
        self._done = asyncio.Event()
        if not self.waiting:
            self._done.set()

    @property
    def key(self) -> tuple[str, Phase]:
        return (self.update_id, self.phase)

    @property
    def complete(self) -> bool:
        return self._done.is_set()

    def offer(self, ack: Ack) -> None:
        if ack.worker_id not in self.waiting or (self.epoch and ack.epoch != self.epoch):
            return
        self.waiting.discard(ack.worker_id)
        self.acks[ack.worker_id] = ack
        if ack.ok and self.first_ok is not None:
            self.first_ok.set()
        if not self.waiting:
            self._done.set()

    def give_up_on(self, worker_ids: Iterable[str]) -> None:
        """Stop waiting for members that are known to be gone."""
        for worker_id in worker_ids:
            if worker_id in self.waiting:
                self.waiting.discard(worker_id)
                self.lost.add(worker_id)
        if not self.waiting:
            self._done.set()

    def drop(self, worker_ids: Iterable[str]) -> None:
        """Stop waiting for members whose ack no longer matters (left out of
        the update for an earlier phase): neither missing nor lost."""
        for worker_id in worker_ids:
            self.waiting.discard(worker_id)
        if not self.waiting:
            self._done.set()

    async def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every member; True once none is left waiting."""
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await self._done.wait()
        except TimeoutError:
            pass
        return self.complete


class AckRouter:
    def __init__(self) -> None:
        self._open: dict[tuple[str, Phase], PhaseGather] = {}

    def expect(
        self,
        update_id: str,
        phase: Phase,
        members: Iterable[str],
        first_ok: asyncio.Event | None = None,
        epoch: int = 0,
    ) -> PhaseGather:
        gather = PhaseGather(update_id, phase, members, first_ok, epoch)
        self._open[gather.key] = gather
        return gather

    def latest(self, update_id: str) -> PhaseGather | None:
        """The phase of ``update_id`` most recently opened, if one is still open."""
        return next((g for g in reversed(self._open.values()) if g.update_id == update_id), None)

    def close(self, gather: PhaseGather) -> None:
        self._open.pop(gather.key, None)

    def route(self, ack: Ack) -> None:
        for each in acks_in(ack):
            gather = self._open.get((each.update_id, each.phase))
            if gather is not None:
                gather.offer(each)
