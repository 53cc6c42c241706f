"""Leader election with fencing epochs, on the fleet's KV leader record.

Several coordinators may run for one fleet; one holds the leader record and
renews it (a compare-and-set that bumps its revision) every third of the
lease. A standby watches the record: when its revision has not moved for a
whole lease by the standby's own clock, the holder is presumed dead and the
standby takes over with a compare-and-set that raises the epoch by one. Only
one standby can win that race. No clocks are compared across machines.

A holder that cannot renew (someone else wrote, or the store is unreachable
for a whole lease) has lost the lease and must stop commanding at once; agents
fence its commands anyway once they have seen the new epoch.

A record that does not decode (garbage written by a leaked credential or a
bug) names nobody: coordinators elect over it, by compare-and-set on its
revision, as over a dead holder's record once it has been silent for a lease,
and at once by the coordinator whose lease it overwrote while that lease
still ran (no standby can have been elected meanwhile: each waits a lease of
silence). Its epoch is unknown, so a new term takes one past the highest this
coordinator knows: its own last term's and the highest the agents' heartbeats
say they have seen (``epoch_floor``), which agents need to take its commands.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from lorabus.coordinator.signals import LeadershipLost, LostRace, StoreUnavailable
from lorabus.coordinator.store import CorruptRecord
from lorabus.runtime.cancellation import raise_if_cancelled
from lorabus.runtime.clock import now
from lorabus.schemas import LeaderRecord

log = logging.getLogger(__name__)

_STEP_DOWN_FRACTION = 0.6


class LeaderStore(Protocol):
    """The leader record with compare-and-set (the fleet's KV; in memory in tests)."""

    async def read_leader(self) -> tuple[LeaderRecord | None, int]:
        """The record and its revision (0 when there is none); StoreUnavailable,
        CorruptRecord (with its revision) when it does not decode."""
        ...

    async def write_leader(self, record: LeaderRecord, last_revision: int) -> int:
        """Write if the revision is still ``last_revision``; the new revision, or
        LostRace; StoreUnavailable."""
        ...


class LeaderElection:
    def __init__(
        self,
        store: LeaderStore,
        holder: str,
        lease_s: float,
        clock: Callable[[], float] = now,
        *,
        signing_key: str = "",
        epoch_floor: Callable[[], int] = lambda: 0,
        on_corrupt: Callable[[CorruptRecord], Awaitable[None]] | None = None,
    ) -> None:
        if lease_s <= 0:
            raise ValueError("leader lease must be > 0")
        self.store = store
        self.holder = holder
        self.signing_key = signing_key
        """Published in the leader record: agents check commands against it."""
        self.lease_s = lease_s
        self._clock = clock
        self.epoch = 0
        self._revision = 0
        self._deferring_s = 0.0
        """Extra silence this coordinator waits for before it campaigns, after
        it stood aside (:meth:`stand_aside`)."""
        self._renewed_at = -float("inf")
        """When this coordinator last wrote the record (its lease runs from there)."""
        self._epoch_floor = epoch_floor
        """The highest epoch known besides the record (the agents' heartbeats)."""
        self._on_corrupt = on_corrupt
        """Told once per revision of a record that does not decode (to audit it)."""

    async def campaign(self) -> int:
        """Wait until this coordinator holds the lease; return its new epoch."""
        seen_revision, seen_at = -1, self._clock()
        while True:
            raise_if_cancelled()
            try:
                record, revision, corrupt = await self._read()
                if revision != seen_revision:
                    seen_revision, seen_at = revision, self._clock()
                    if corrupt is not None and self._on_corrupt is not None:
                        await self._on_corrupt(corrupt)
                silent_for = self._clock() - seen_at
                # Our own record, untouched since we last wrote it (we stepped
                # down, say, because the bus was away): nobody else leads.
                ours = (
                    record is not None
                    and record.holder == self.holder
                    and revision == self._revision
                )
                # Garbage over the lease we still held: nobody was elected since.
                overwritten = (
                    corrupt is not None
                    and self._deferring_s == 0.0
                    and self._clock() - self._renewed_at < self.lease_s
                )
                vacant = record is None and corrupt is None
                if vacant or ours or overwritten or silent_for >= self.lease_s + self._deferring_s:
                    epoch = max(record.epoch if record else 0, self.epoch, self._epoch_floor()) + 1
                    self._revision = await self.store.write_leader(self._record(epoch), revision)
                    self.epoch, self._deferring_s = epoch, 0.0
                    self._renewed_at = self._clock()
                    if corrupt is not None:
                        log.warning(
                            "coordinator %s leads with epoch %d, elected over a leader "
                            "record that did not decode",
                            self.holder,
                            epoch,
                        )
                    else:
                        log.info("coordinator %s leads with epoch %d", self.holder, epoch)
                    return epoch
            except LostRace:
                seen_revision = -1  # someone else moved first: watch the new holder
            except StoreUnavailable as exc:
                log.warning("leader election: %s", exc)
            await asyncio.sleep(self.lease_s / 4)

    async def _read(self) -> tuple[LeaderRecord | None, int, CorruptRecord | None]:
        """The record and its revision; one that does not decode reads as none,
        with the error beside it."""
        try:
            record, revision = await self.store.read_leader()
        except CorruptRecord as corrupt:
            return None, corrupt.revision, corrupt
        return record, revision, None

    async def hold(self) -> None:
        """Renew the lease until it is lost; then raise LeadershipLost."""
        renewed_at = self._clock()
        while True:
            raise_if_cancelled()
            await asyncio.sleep(self.lease_s / 4)
            try:
                self._revision = await self.store.write_leader(
                    self._record(self.epoch), self._revision
                )
                renewed_at = self._renewed_at = self._clock()
            except LostRace as exc:
                raise LeadershipLost(f"another coordinator took the lease: {exc}") from exc
            except StoreUnavailable as exc:
                # Step down well before a standby may take over (a full lease
                # of silence), so two leaders never command at once.
                if self._clock() - renewed_at >= self.lease_s * _STEP_DOWN_FRACTION:
                    raise LeadershipLost(f"could not renew the lease in time: {exc}") from exc
                log.warning("epoch=%d lease renewal failed, retrying: %s", self.epoch, exc)

    def stand_aside(self) -> None:
        """Campaign next behind any standby: take the lease only after two
        whole leases of silence, not at once because the record is still
        ours, so that a standby watching it (which waits one) takes over."""
        self._revision = 0
        self._deferring_s = self.lease_s

    def _record(self, epoch: int) -> LeaderRecord:
        return LeaderRecord(holder=self.holder, epoch=epoch, signing_key=self.signing_key)
