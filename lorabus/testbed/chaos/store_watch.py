"""Sampling the fleet's adapter object store against the records that keep it.

The leader deletes an object of the store only when no record keeps it
(coordinator/adapter_store.py). To check that from outside, the run looks
every ``every_s`` from its own connection (full rights, node 0 in a cluster):
it reads the records (every adapter's commit point and latest reset, and the
update in flight), then lists the store, then reads the records again, and
writes the three reads into the timeline as one :class:`StoreSample`. The
invariant ``store_keeps`` (:mod:`lorabus.testbed.chaos.store_keeps`) judges
the samples after the run.

A record is written down as what it keeps, under a name that says which
record it is: the same name in both reads means the same record, unchanged
in between (a commit point is written once; an in-flight record belongs to
one update until it is cleared, and an update id is never run twice), so
what it keeps was kept throughout, the listing included. Reading what the
records keep is done here, independently of the coordinator's own
``keepers``, so that a mistake there is not copied into the check. An
object counts as stored only with its meta and every chunk it counts: one
whose chunks are gone is as lost as one whose meta is.

A sample that cannot be read whole (nats-server restarting, a link cut, a
record that does not decode) is skipped and counted, not judged.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterable

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient

from lorabus.adapters.bus_paths import digest_of
from lorabus.adapters.store import store_contents
from lorabus.coordinator.signals import StoreUnavailable
from lorabus.coordinator.store import FleetStore
from lorabus.errors import BusError
from lorabus.schemas import CommittedRecord, InflightRecord, ResetRecord, Subjects
from lorabus.testbed.chaos.timeline import StoreSample, Timeline, now

log = logging.getLogger(__name__)

_LIST_TIMEOUT_S = 5.0
"""How long one listing of the store may take before the sample is skipped."""


def record_names(
    committed: dict[str, CommittedRecord],
    resets: dict[str, ResetRecord],
    in_flight: Iterable[InflightRecord] = (),
) -> dict[str, frozenset[str]]:
    """What each record keeps in the store, by a name of the record that is
    the same in two reads only if the record is: each adapter's committed
    version and the versions kept beside it, the versions a reset kept (while
    its adapter has no commit point), and every update in flight (its
    adapter, and the commit it carries)."""
    names: dict[str, set[str]] = {}

    def keep(name: str, path_or_digest: str | None) -> None:
        if path_or_digest is not None:
            names.setdefault(name, set()).add(path_or_digest)

    for adapter, record in sorted(committed.items()):
        point = f"the commit point of {adapter} v{record.version} ({_fingerprint(record)})"
        keep(f"{adapter} v{record.version}, committed by {point}", _digest(record.path))
        for kept in record.kept:
            keep(f"{adapter} v{kept.version}, kept by {point}", _digest(kept.path))
    for adapter, reset in sorted(resets.items()):
        if adapter in committed:
            continue  # its commit point keeps what it still keeps of the reset's
        of = f"the reset of {adapter} to lineage {reset.lineage} ({_fingerprint(reset)})"
        for kept in reset.kept:
            keep(f"{adapter} v{kept.version}, kept by {of}", _digest(kept.path))
    for flight in in_flight:
        update = f"update {flight.update_id} in flight ({flight.adapter} v{flight.version})"
        keep(update, _digest(flight.path))
        carried = flight.committing
        if carried is not None:
            commit = f"the commit of {carried.adapter} v{carried.version} that {update} carries"
            keep(
                f"{carried.adapter} v{carried.version}, committed by {commit}",
                _digest(carried.path),
            )
            for kept in carried.kept:
                keep(f"{carried.adapter} v{kept.version}, kept by {commit}", _digest(kept.path))
    return {name: frozenset(digests) for name, digests in names.items()}


def _digest(path: str) -> str | None:
    try:
        return digest_of(path)
    except ValueError:
        return None  # not a bus path the coordinator would have taken: names nothing


def _fingerprint(record: CommittedRecord | ResetRecord) -> str:
    """A short hash of the record as written: two reads of one key with the
    same fingerprint read the same write."""
    return "#" + hashlib.sha256(msgspec.json.encode(record)).hexdigest()[:10]


async def read_names(records: FleetStore) -> dict[str, frozenset[str]]:
    """What the state bucket's records keep now (:func:`record_names`).
    StoreUnavailable when one cannot be read."""
    committed, resets = await records.read_adapter_records()
    return record_names(committed, resets, await records.read_inflights())


class StoreWatcher:
    """Takes a :class:`StoreSample` every ``every_s`` into the timeline."""

    def __init__(
        self,
        nc: NatsClient,
        subjects: Subjects,
        records: FleetStore,
        timeline: Timeline,
        *,
        every_s: float,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.records = records
        self.timeline = timeline
        self.every_s = every_s

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            await self.sample()
            # A sampling period: a time, not a condition.
            await asyncio.sleep(self.every_s)

    async def sample(self) -> StoreSample | None:
        """One sample, recorded in the timeline; None (counted as skipped) when
        a read failed."""
        began = now()
        try:
            before = await read_names(self.records)
            listed_from = now()
            contents = await store_contents(self.nc, self.subjects, timeout_s=_LIST_TIMEOUT_S)
            listed_to = now()
            after = await read_names(self.records)
        except (StoreUnavailable, BusError, nats.errors.Error, TimeoutError) as exc:
            self.timeline.store_samples_skipped += 1
            log.debug("store sample skipped: %r", exc)
            return None
        sample = StoreSample(
            began=began,
            listed_from=listed_from,
            listed_to=listed_to,
            ended=now(),
            before=before,
            after=after,
            stored=frozenset(d for d in contents.objects if contents.complete.get(d)),
        )
        self.timeline.store_samples.append(sample)
        return sample
