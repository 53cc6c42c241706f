"""The leader record's store, in memory, for the election's tests.

:class:`MemoryLeaderStore` stands in for the KV bucket where the leading
coordinator's record lives: compare-and-set by revision, and an unreachable
store. The update lifecycle has no doubles here: it runs the real agents and
the real coordinator on an in-memory bus (``memory_fleet.py``).
"""

from __future__ import annotations

from lorabus.coordinator.signals import LostRace, StoreUnavailable
from lorabus.schemas import LeaderRecord


class MemoryLeaderStore:
    """The leader record with compare-and-set, in memory; ``reachable`` False makes
    every call fail as an unreachable KV store does."""

    def __init__(self) -> None:
        self.record: LeaderRecord | None = None
        self.revision = 0
        self.reachable = True

    async def read_leader(self) -> tuple[LeaderRecord | None, int]:
        self._check_reachable()
        return self.record, self.revision

    async def write_leader(self, record: LeaderRecord, last_revision: int) -> int:
        self._check_reachable()
        if last_revision != self.revision:
            raise LostRace(f"revision {self.revision}, not {last_revision}")
        self.record, self.revision = record, self.revision + 1
        return self.revision

    def _check_reachable(self) -> None:
        if not self.reachable:
            raise StoreUnavailable("the KV store does not answer")
