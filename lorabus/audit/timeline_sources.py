"""Where ``lorabus audit timeline`` gets the records it draws: a trail file,
or the fleet's audit stream, of which it reads only the updates it draws;
and which of the updates it meets are those asked for (:func:`select`).

A trail file is read a line at a time into the timelines, keeping no record.

The stream may hold a GiB of earlier updates (``--audit-max-bytes``), so it
is not read from its start. An update shows first as the coordinator's
``update_started`` event or, for a request answered without running, as its
``update_finished``. Those two subjects are walked back from the stream's
end, one direct get of a subject's last record up to a sequence at a time,
until the updates asked for (``--update``) or the last K (``--last``) have
been met (for an id the stream does not show: back to its first update).
One update runs at a time per fleet, so a finish that the next older start
does not share belongs to a request that never ran. Each update drawn is
then read from its first record up to the next update's start (the last
ones: to the stream's end) and drawn as from a file. A walk that reaches
the stream's first update without meeting them all reads the stream's head
too (an update whose start the stream's limits dropped), and ``--last K``
with fewer than K updates in the stream reads it all.

A pause still open where an update's records end is followed on its
worker's own subjects only: its acks up to a resume, its agent's
``engine_resumed`` and ``lease_expired`` events. A pause that nothing
resumed runs to the trail's end, the time of the stream's last record: one
direct get. So what is read is the updates drawn, the entries walked past
to find them and those few records; what is kept is the timelines drawn.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lorabus.audit.tap import BATCH, StreamReader
from lorabus.audit.timeline import TimelineBuilder, UpdateTimeline
from lorabus.audit.trail_file import BadLine, trail_items
from lorabus.audit.verify import DEFAULT_PREFIX, TrailRecord
from lorabus.schemas import check_token

_FOLLOW_BATCH = 8
"""The most records of one worker's subject read at a time while following a pause."""


@dataclass(frozen=True)
class Selection:
    """The updates asked for, out of those a trail shows."""

    timelines: list[UpdateTimeline]
    """Those asked for, in the order asked (``--last``: the trail's); none
    when any is unknown."""
    unknown: list[str]
    """Ids asked for that the trail does not show."""
    shown: list[str]
    """The ids of the updates the trail shows, in its order (for saying what
    it holds when an id is unknown)."""
    poison: int = 0
    """Poison records read (left out)."""


def select(
    timelines: Sequence[UpdateTimeline],
    update_ids: Sequence[str],
    last: int,
    *,
    shown: Sequence[str] | None = None,
    poison: int = 0,
) -> Selection:
    """``update_ids`` out of ``timelines`` (any unknown: none), or without ids
    the last ``last`` of them. ``shown``: every update the trail shows (by
    default those of ``timelines``)."""
    ids = [t.update_id for t in timelines] if shown is None else list(shown)
    if not update_ids:
        return Selection(list(timelines[-last:]), [], ids, poison)
    known = {t.update_id: t for t in timelines}
    unknown = [u for u in update_ids if u not in known]
    chosen = [] if unknown else [known[u] for u in update_ids]
    return Selection(chosen, unknown, ids, poison)


def from_file(
    path: str | Path, update_ids: Sequence[str], last: int, prefix: str = DEFAULT_PREFIX
) -> tuple[Selection, int]:
    """The updates asked for out of a trail file (of a fleet whose subjects
    start with ``prefix``), and how many of its lines are no record."""
    builder = TimelineBuilder(prefix=prefix)
    bad_lines = 0
    for item in trail_items(path):
        if isinstance(item, BadLine):
            bad_lines += 1
        else:
            builder.take(item)
    return select(builder.timelines(), update_ids, last, poison=builder.poison), bad_lines


async def from_stream(reader: StreamReader, update_ids: Sequence[str], last: int) -> Selection:
    """The updates asked for out of the audit stream, reading only theirs."""
    prefix = reader.subjects.prefix
    stored = await reader.stored()
    if not stored:
        return select([], update_ids, last)
    walk = await _walk_back(reader, stored, _done(update_ids, last))
    whole = walk.exhausted and not update_ids and walk.resolved_count() < last
    if whole:  # fewer updates than asked for: all of the stream, as from a file
        builder, spans = TimelineBuilder(prefix=prefix), [_Span(stored.start, None)]
    else:
        wanted = list(update_ids) or walk.newest(last)
        builder = TimelineBuilder(draw=set(wanted), prefix=prefix)
        spans = walk.spans(wanted, stored.start)
    followed: set[tuple[str, str]] = set()
    for span in _merged(spans):
        await _read_span(reader, builder, span)
        if span.last is not None:
            await _follow_pauses(reader, builder, span.last, followed)
    timelines = builder.timelines(await _trail_end(reader, stored, spans))
    shown = None if whole else walk.shown()
    return select(timelines, update_ids, last, shown=shown, poison=builder.poison)


@dataclass(frozen=True)
class _Span:
    first: int
    last: int | None
    """None: to the stream's end."""


@dataclass
class _Walk:
    """What walking back over the updates' first records met."""

    placed: dict[str, int] = field(default_factory=dict)
    """update id -> the sequence of its first record met (its start, or its
    only finish)."""
    starts: list[int] = field(default_factory=list)
    """The sequences of the starts met, newest first."""
    unresolved: set[str] = field(default_factory=set)
    """Updates met by a finish since the last start met: they ran from an
    older start, or never ran."""
    exhausted: bool = False
    """The walk went back past the stream's first update."""

    def meet(self, record: TrailRecord, *, started: bool) -> None:
        update_id = record.message.get("update_id")
        if record.poison or not isinstance(update_id, str) or not update_id:
            return
        self.placed[update_id] = record.seq
        if started:
            self.starts.append(record.seq)
            # The start before a finish is the update that ran then: the
            # others met by a finish since then never ran.
            self.unresolved.clear()
        else:
            self.unresolved.add(update_id)

    def resolved(self, update_id: str) -> bool:
        return update_id in self.placed and update_id not in self.unresolved

    def resolved_count(self) -> int:
        return len(self.placed) - len(self.unresolved)

    def shown(self) -> list[str]:
        """The updates met, oldest first."""
        return sorted(self.placed, key=self.placed.__getitem__)

    def newest(self, count: int) -> list[str]:
        return self.shown()[-count:]

    def spans(self, update_ids: Sequence[str], head: int) -> list[_Span]:
        """Each update's records, from its first to the next update's start.
        One not met, or met by a finish alone when the walk went back past
        every start, is read from the stream's head: its start may be one the
        stream's limits dropped."""
        spans = []
        for update_id in update_ids:
            first = self.placed.get(update_id)
            since = head if first is None or update_id in self.unresolved else first
            later = [seq for seq in self.starts if seq > (first or head)]
            spans.append(_Span(since, min(later) - 1 if later else None))
        return spans


def _done(update_ids: Sequence[str], last: int) -> Callable[[_Walk], bool]:
    """When the walk has met what is asked for."""
    if update_ids:
        return lambda walk: all(walk.resolved(u) for u in update_ids)
    return lambda walk: walk.resolved_count() >= last


async def _walk_back(reader: StreamReader, stored: range, done: Callable[[_Walk], bool]) -> _Walk:
    """Meet the updates' first records from the stream's end back, until ``done``."""
    subjects = reader.subjects
    started = subjects.coordinator_event("update_started")
    finished = subjects.coordinator_event("update_finished")
    below = {started: stored[-1], finished: stored[-1]}
    """The next record of each subject met is the last at or before this."""
    heads: dict[str, TrailRecord | None] = {}
    walk = _Walk()
    while not done(walk):
        for subject in below.keys() - heads.keys():
            heads[subject] = await reader.last_on(subject, below[subject])
        met = [record for record in heads.values() if record is not None]
        if not met:
            walk.exhausted = True
            break
        record = max(met, key=lambda r: r.seq)
        del heads[record.subject]
        below[record.subject] = record.seq - 1
        walk.meet(record, started=record.subject == started)
    return walk


def _merged(spans: Sequence[_Span]) -> list[_Span]:
    """``spans`` in stream order, those that touch or overlap as one."""
    merged: list[_Span] = []
    for span in sorted(spans, key=lambda s: s.first):
        before = merged[-1] if merged else None
        if before is None or (before.last is not None and span.first > before.last + 1):
            merged.append(span)
        elif before.last is None or span.last is None:
            merged[-1] = _Span(before.first, None)
        else:
            merged[-1] = _Span(before.first, max(before.last, span.last))
    return merged


async def _read_span(reader: StreamReader, builder: TimelineBuilder, span: _Span) -> None:
    """Give ``builder`` the records of ``span``, a batch at a time."""
    seq = span.first
    while span.last is None or seq <= span.last:
        limit = BATCH if span.last is None else min(BATCH, span.last - seq + 1)
        batch = await reader.batch({"seq": seq}, limit)
        if not batch:
            return
        for record in batch:
            if span.last is not None and record.seq > span.last:
                return
            builder.take(record)
        seq = batch[-1].seq + 1


async def _trail_end(reader: StreamReader, stored: range, spans: Sequence[_Span]) -> float | None:
    """The time of the stream's last record, where no span read up to it."""
    if any(span.last is None for span in spans):
        return None  # the builder took it
    found = await reader.batch({"seq": stored[-1]}, 1)
    return found[0].ts if found and math.isfinite(found[0].ts) else None


async def _follow_pauses(
    reader: StreamReader, builder: TimelineBuilder, after: int, followed: set[tuple[str, str]]
) -> None:
    """Give ``builder`` the records after ``after`` that resume the engines
    still paused (each pause followed once: what one look did not find, a
    later one would not either)."""
    for worker, updates in builder.open_pauses().items():
        fresh = {u for u in updates if (worker, u) not in followed}
        followed.update((worker, u) for u in fresh)
        if not fresh or not _is_token(worker):
            continue
        for record in await _resumes_of(reader, worker, updates, after):
            builder.end_pauses(record)


async def _resumes_of(
    reader: StreamReader, worker: str, updates: set[str], after: int
) -> list[TrailRecord]:
    """The records after ``after`` that end the pauses of ``worker``'s engine
    (by ``updates``), in stream order: its agent's first ``engine_resumed``,
    which ends them all; the ``lease_expired`` events before it, which end one
    each; and its first ok resume ack before those end them all."""
    subjects = reader.subjects
    engine = await _first(
        reader, subjects.agent_event(worker, "engine_resumed"), after, None, _of("engine_resumed")
    )
    until = engine.seq if engine is not None else None
    found = [engine] if engine is not None else []
    left = set(updates)
    lease_subject = subjects.agent_event(worker, "lease_expired")
    async with contextlib.aclosing(_records_on(reader, lease_subject, after, until)) as leases:
        async for lease in leases:
            if _of("lease_expired")(lease) and lease.message.get("update_id") in left:
                found.append(lease)
                left.discard(str(lease.message.get("update_id")))
                if not left:
                    until = lease.seq
                    break
    ack = await _first(reader, subjects.ack(worker), after, until, _ok_resume)
    return sorted([*found, *([ack] if ack is not None else [])], key=lambda r: r.seq)


async def _first(
    reader: StreamReader,
    subject: str,
    after: int,
    until: int | None,
    matches: Callable[[TrailRecord], bool],
) -> TrailRecord | None:
    """The first record on ``subject`` after ``after`` (and before ``until``)
    that ``matches``."""
    async with contextlib.aclosing(_records_on(reader, subject, after, until)) as records:
        async for record in records:
            if matches(record):
                return record
    return None


async def _records_on(
    reader: StreamReader, subject: str, after: int, until: int | None
) -> AsyncGenerator[TrailRecord]:
    """The records on ``subject`` after sequence ``after`` and before ``until``
    (None: to the stream's end), one, then two, then a few at a time (the one
    looked for is most often the first)."""
    seq, limit = after + 1, 1
    while True:
        batch = await reader.next_on(subject, seq, limit)
        for record in batch:
            if until is not None and record.seq >= until:
                return
            yield record
        if not batch:
            return
        seq, limit = batch[-1].seq + 1, min(2 * limit, _FOLLOW_BATCH)


def _of(kind: str) -> Callable[[TrailRecord], bool]:
    return lambda record: not record.poison and record.message.get("type") == kind


def _ok_resume(record: TrailRecord) -> bool:
    message = record.message
    return not record.poison and message.get("phase") == "resume" and message.get("ok") is True


def _is_token(worker: str) -> bool:
    """Whether ``worker`` (read from the trail) can stand in a subject."""
    try:
        check_token("worker id", worker)
    except ValueError:
        return False
    return True
