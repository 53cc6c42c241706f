"""Moving a placed adapter off a worker that left.

An adapter placed on some workers (``placement.py``) must not lose a replica
for good when one of them leaves: its engine died, its node was drained.
Once a placed worker has been silent for ``--replace-after`` seconds (30 by
default: an agent's restart, back within seconds, moves nothing), the
leader places the adapter again: every worker placed that has not left
stays (also one restarting), and live, ready workers that match its
selector and have room, the least loaded first, take the places of those
gone. It rewrites the adapter's commit point with the new workers and a
rank map over them (agents take the commit points over the fleet's latest
record, which it leaves as it was), and tells every agent in a
``committed`` notice: the new workers load its versions as any agent
converges on what is committed.

It runs under the adapter's turn (no update or reset of it meanwhile) and
the records gate (no sweep in the middle), and only while the term leads.
Only workers with room for the adapter's versions (by their capacity) take
a place; where none can, the adapter stays where it is, a replica short,
and the leader says so in its log (once, until that changes). The rewrite
is a compare-and-set on the commit point's revision, read under the turn,
so a deposed leader never overwrites what its successor wrote.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from lorabus.coordinator.commit import announce, committed_notice
from lorabus.coordinator.placement import Placement, place, serving
from lorabus.coordinator.signals import StoreUnavailable
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
        known = term.book.committed.get(adapter)
        if known is None or not (gone := _departed(term, known)):
            return  # an update or a reset came first
        record, revision = await term.store.read_commit_point(adapter)
        if record is None or _what_is_served(record) != _what_is_served(known):
            return  # written by another hand: this term's book is behind
        extra = _replacements(term, record, gone)
        if not extra:
            if stuck.get(adapter) != gone:
                stuck[adapter] = gone
                log.warning(
                    "epoch=%d adapter %s: placed workers %s left, and no live worker that "
                    "matches its selector has room for it: it stays on the others",
                    term.epoch,
                    adapter,
                    gone,
                )
            return
        # The rest stay, also those away for less than --replace-after.
        chosen = sorted({*(w for w in record.workers if w not in gone), *extra})
        live = term.membership.live()
        sizes = {e.worker_id: e.world_size for e in record.rank_map.entries}
        sizes |= {w: live[w].heartbeat.world_size for w in chosen if w in live}
        moved = msgspec.structs.replace(
            record,
            workers=chosen,
            rank_map=build_rank_map(
                {w: sizes[w] for w in chosen if w in sizes}, term.membership.layouts(chosen)
            ),
        )
        if not await term.still_leading():
            return
        try:
            # The commit point is the truth agents converge on; the latest
            # record only stands in for it where they cannot list the points.
            # By compare-and-set: a deposed leader's view never overwrites.
            await term.store.move_commit_point(moved, revision)
        except StoreUnavailable as exc:
            log.warning("epoch=%d adapter %s not moved yet: %s", term.epoch, adapter, exc)
            return
        stuck.pop(adapter, None)
        _keep_latest(term, moved)
        log.info("epoch=%d adapter %s moved off %s: now on %s", term.epoch, adapter, gone, chosen)
    update_id = f"placement-{adapter.replace('/', '.')}-{int(time.time())}"[:128]
    await announce(term, committed_notice(term, moved, update_id=update_id))


def _what_is_served(record: CommittedRecord) -> tuple[int, int, str, list[str]]:
    return (record.lineage, record.version, record.path, record.workers)


def _replacements(term: Term, record: CommittedRecord, gone: list[str]) -> list[str]:
    """Live, ready workers not placed yet that match the record's selector
    and have room for the adapter's versions: one per worker gone, or as
    many as there are."""
    beats = {
        w: m.heartbeat
        for w, m in term.membership.live().items()
        if m.heartbeat.ready and w not in record.workers
    }
    own = [record.served_name, *(k.served_name for k in record.kept if k.served_name)]
    others = serving(r for r in term.book.committed.values() if r.adapter != record.adapter)
    for count in range(len(gone), 0, -1):
        extra = place(
            record.adapter,
            Placement(replicas=count, selector=record.selector),
            beats,
            now_on=[],
            own=own,
            beside=others,
            with_room_only=True,
        )
        if extra is not None:
            return extra
    return []


def _keep_latest(term: Term, moved: CommittedRecord) -> None:
    """The book takes ``moved`` as the adapter's commit point, and as the
    fleet's latest commit only if that was the adapter's already."""
    latest = term.book.latest
    term.book.commit(moved)
    if latest is not None and latest.adapter != moved.adapter:
        term.book.latest = latest
