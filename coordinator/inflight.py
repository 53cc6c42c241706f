"""The update in flight, sent ahead of the commands a successor must undo.

Only the pause and the load change what a successor must undo (resume every
member; withdraw the new version too): the record is written once before
the pause, as the load (the pause carries it; a fixed-name update writes the
pause, then the load), and before the load in live mode. Later phases are
not written, as each write carries the whole membership, and the record
never steps back to an earlier phase. ``recovery.py`` is what reads it.

The record goes out on the connection ahead of the command, and the command
does not wait for the server to store it: a record that is not stored must
not stop the engines being driven (and resumed), so waiting would only add
a round trip to every update.
"""

from __future__ import annotations

import asyncio
import logging

from lorabus.coordinator.plan import UpdatePlan
from lorabus.coordinator.ports import Journal
from lorabus.schemas import InflightRecord, Phase

log = logging.getLogger(__name__)

_RECORDED_PHASES = (Phase.PAUSE, Phase.LOAD)


class InflightJournal:
    """One update's in-flight record, written through ``journal``."""

    def __init__(self, journal: Journal, plan: UpdatePlan, epoch: int) -> None:
        self._journal = journal
        self._plan = plan
        self._epoch = epoch
        self._recorded: Phase | None = None
        self._writes: list[asyncio.Task[None]] = []

    async def record(self, phase: Phase, members: dict[str, int]) -> None:
        """Send the update as of ``phase``, on ``members``, unless it was sent
        as of that phase or a later one already."""
        order = _RECORDED_PHASES.index
        if self._recorded is not None and order(phase) <= order(self._recorded):
            return
        self._recorded = phase
        plan = self._plan
        in_flight = InflightRecord(
            update_id=plan.update_id,
            epoch=self._epoch,
            phase=phase,
            adapter=plan.adapter,
            served_name=plan.served_name,
            version=plan.version,
            members=members,
            path=plan.path,
        )
        self._writes.append(asyncio.create_task(self._write(in_flight)))
        # One turn of the loop: the write's publish is queued on the connection
        # before the command's (and after an earlier record's, so they land in order).
        await asyncio.sleep(0)

    async def ended(self) -> bool:
        """Once every write has ended (stored, or failed and logged): whether
        any was sent."""
        await asyncio.gather(*self._writes)
        return bool(self._writes)

    async def _write(self, in_flight: InflightRecord) -> None:
        try:
            await self._journal.record(in_flight)
        except Exception as exc:  # the engines must still be driven (and resumed)
            log.warning(
                "update=%s could not record phase %s: %s",
                in_flight.update_id,
                in_flight.phase,
                exc,
            )
