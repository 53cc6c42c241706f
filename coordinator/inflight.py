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
a round trip to every update. Once the run has ended, :meth:`InflightJournal.
ended` says what was sent and the revision it was stored at: a commit is
claimed, and the record cleared, by compare-and-set on that revision
(``commit.py``), so a term deposed meanwhile changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from lorabus.coordinator.plan import UpdatePlan
from lorabus.coordinator.ports import Journal
from lorabus.schemas import InflightRecord, Phase

log = logging.getLogger(__name__)

_RECORDED_PHASES = (Phase.PAUSE, Phase.LOAD)


@dataclass(frozen=True)
class Journalled:
    """The in-flight record an update sent last, once every write has ended."""

    record: InflightRecord
    revision: int | None
    """Its revision in the store; None when a write failed (whether it was
    stored is unknown)."""


class InflightJournal:
    """One update's in-flight record, written through ``journal``."""

    def __init__(self, journal: Journal, plan: UpdatePlan, epoch: int) -> None:
        self._journal = journal
        self._plan = plan
        self._epoch = epoch
        self._recorded: Phase | None = None
        self._writes: list[asyncio.Task[None]] = []
        self._last: InflightRecord | None = None
        self._revision: int | None = 0

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
        self._last = in_flight
        self._writes.append(asyncio.create_task(self._write(in_flight)))
        # One turn of the loop: the write's publish is queued on the connection
        # before the command's (and after an earlier record's, so they land in order).
        await asyncio.sleep(0)

    async def ended(self) -> Journalled | None:
        """Once every write has ended (stored, or failed and logged): the last
        record sent, or None when none was."""
        await asyncio.gather(*self._writes)
        if self._last is None:
            return None
        return Journalled(self._last, self._revision)

    async def _write(self, in_flight: InflightRecord) -> None:
        try:
            revision = await self._journal.record(in_flight)
        except Exception as exc:  # the engines must still be driven (and resumed)
            self._revision = None
            log.warning(
                "update=%s could not record phase %s: %s",
                in_flight.update_id,
                in_flight.phase,
                exc,
            )
        else:
            if self._revision is not None:
                self._revision = max(self._revision, revision)
