"""Moving a placed adapter off a worker that left.

An adapter placed on some workers (``placement.py``) must not lose a replica
for good when one of them leaves: its engine died, its node was drained. Once
a placed worker has been silent for ``--replace-after`` seconds (30 by
default: an agent's restart, back within seconds, moves nothing), the leader places the adapter
again, as an update would: the workers that still serve it stay, and others
that match its selector, with room, the least loaded first, take the place
of those gone. It rewrites the adapter's commit point with the new workers
and a rank map over them (agents take the commit points over the fleet's
latest record, which it leaves as it was), and tells every agent in a ``committed`` notice: the new
workers load its versions as any agent converges on what is committed.

It runs under the adapter's turn (no update or reset of it meanwhile) and
the records gate (no sweep in the middle), and only while the term leads.
Where no live worker can take the place, the adapter stays where it is, one
replica short, and the leader says so in its log (once, until that changes).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from lorabus.coordinator.commit import announce, committed_notice
from lorabus.coordinator.placement import Placement, place, serving
from lorabus.coordinator.signals import StoreUnavailable
from lorabus.coordinator.store import until_stored
from lorabus.coordinator.term import Term
from lorabus.schemas import CommittedRecord, build_rank_map

log = logging.getLogger(__name__)

CHECK_EVERY_S = 2.0


async def replace_departed(term: Term) -> None:
    """For one term: every ``CHECK_EVERY_S``, move each placed adapter off
    the workers that left. Runs until cancelled with its term."""
    stuck: dict[str, list[str]] = {}
    """Adapter -> the workers it could not move off, as last warned of."""
    while True:
        await asyncio.sleep(CHECK_EVERY_S)
        if not term.leading.is_set():
            continue  # still recovering: the book is not this term's yet
        for adapter, record in sorted(term.book.committed.items()):
            if _departed(term, record):
                await _replace(term, adapter, stuck)
            else:
                stuck.pop(adapter, None)


def _departed(term: Term, record: CommittedRecord) -> list[str]:
    after_s = term.config.replace_after_s
    return [w for w in record.workers if term.membership.silent_for(w) >= after_s]


async def _replace(term: Term, adapter: str, stuck: dict[str, list[str]]) -> None:
    async with term.adapter_turn(adapter), term.records.writing():
        record = term.book.committed.get(adapter)
        if record is None or not (gone := _departed(term, record)):
            return  # an update or a reset came first
        beats = {w: m.heartbeat for w, m in term.membership.live().items() if m.heartbeat.ready}
        staying = [w for w in record.workers if w not in gone]
        others = [r for r in term.book.committed.values() if r.adapter != adapter]
        chosen = None
        for replicas in range(len(record.workers), len(staying), -1):
            chosen = place(
                adapter,
                Placement(replicas=replicas, selector=record.selector),
                beats,
                now_on=staying,
                served_name=record.served_name,
                beside=serving(others),
            )
            if chosen is not None:
                break
        if chosen is None or set(chosen) <= set(staying):
            if stuck.get(adapter) == gone:
                return  # said already
            stuck[adapter] = gone
            log.warning(
                "epoch=%d adapter %s: placed workers %s left, and no live worker can take "
                "their place: it stays on %s",
                term.epoch,
                adapter,
                gone,
                staying,
            )
            return
        if not await term.still_leading():
            return
        moved = msgspec.structs.replace(
            record,
            workers=chosen,
            rank_map=build_rank_map({w: beats[w].world_size for w in chosen if w in beats}),
        )
        try:
            # The commit point is the truth agents converge on; the latest
            # record only stands in for it where they cannot list the points.
            await until_stored(lambda: term.store.commit(moved), for_s=term.config.leader_lease_s)
        except StoreUnavailable as exc:
            log.warning("epoch=%d adapter %s not moved yet: %s", term.epoch, adapter, exc)
            return
        _keep_latest(term, moved)
        log.info("epoch=%d adapter %s moved off %s: now on %s", term.epoch, adapter, gone, chosen)
    update_id = f"placement-{adapter.replace('/', '.')}-{int(time.time())}"[:128]
    await announce(term, committed_notice(term, moved, update_id=update_id))


def _keep_latest(term: Term, moved: CommittedRecord) -> None:
    """The book takes ``moved`` as the adapter's commit point, and as the
    fleet's latest commit only if that was the adapter's already."""
    latest = term.book.latest
    term.book.commit(moved)
    if latest is not None and latest.adapter != moved.adapter:
        term.book.latest = latest
