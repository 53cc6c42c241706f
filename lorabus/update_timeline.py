"""What each worker did in one update, and when, read from an audit trail.

The trail holds what the timeline needs already: the coordinator's
``update_started``, ``phase_finished`` (with its duration) and
``update_finished`` (with the rank map) events, and every agent's acks, each
stored when it was sent and carrying how long its phase took on that worker
(a load's ack that carries its pause carries the pause's time too). A bar is
``[stored - duration, stored]``: the agent's own clock for the length, the
stream's for the end, so that workers line up on one clock.

Everything here is data read from the bus, so nothing in it is trusted: a
record that is not what lorabus writes is skipped, never raised.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorabus.audit import TrailRecord

PHASE_LABELS = {"prepare": "fetch"}
"""The name a person knows a phase by, where it differs from the wire's."""


@dataclass(frozen=True)
class Bar:
    phase: str
    start: float
    end: float
    ok: bool = True
    error: str = ""

    @property
    def duration_s(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        return PHASE_LABELS.get(self.phase, self.phase)


@dataclass
class WorkerRow:
    worker_id: str
    world_size: int = 0
    rank_offset: int | None = None
    bars: list[Bar] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)
    """Phases the coordinator gave up waiting for this worker in."""

    @property
    def error(self) -> str:
        """The first failure of this worker in the update ("" when none)."""
        failed = next((b.error or "failed" for b in self.bars if not b.ok), "")
        if failed or not self.unanswered:
            return failed
        return f"no answer in {', '.join(self.unanswered)}"

    @property
    def longest(self) -> Bar | None:
        return max(self.bars, key=lambda b: b.duration_s, default=None)

    @property
    def paused(self) -> tuple[float, float] | None:
        """From its engine's pause to its resume, as its acks tell it."""
        pauses = [b.end for b in self.bars if b.phase == "pause" and b.ok]
        resumes = [b.end for b in self.bars if b.phase == "resume"]
        if not pauses:
            return None
        start = min(pauses)
        ends = [end for end in resumes if end >= start]
        return (start, min(ends)) if ends else (start, start)


@dataclass
class UpdateTimeline:
    update_id: str
    adapter: str = ""
    version: int | None = None
    started: float | None = None
    ended: float | None = None
    status: str = ""
    error: str = ""
    served_name: str = ""
    coordinator: list[Bar] = field(default_factory=list)
    workers: dict[str, WorkerRow] = field(default_factory=dict)

    @property
    def span(self) -> tuple[float, float]:
        """The first and last instant anything of the update shows."""
        times = [t for t in (self.started, self.ended) if t is not None]
        for bar in self.coordinator:
            times += (bar.start, bar.end)
        for row in self.workers.values():
            for bar in row.bars:
                times += (bar.start, bar.end)
        return (min(times), max(times)) if times else (0.0, 0.0)

    @property
    def slowest(self) -> tuple[str, Bar] | None:
        """The worker with the longest phase, and that phase: where a slow
        update's time went."""
        longest = [(row.worker_id, row.longest) for row in self.workers.values()]
        found = [(w, b) for w, b in longest if b is not None]
        return max(found, key=lambda wb: wb[1].duration_s, default=None)

    @property
    def failed(self) -> list[WorkerRow]:
        return [row for row in self.workers.values() if row.error]

    @property
    def pause_window(self) -> tuple[float, float] | None:
        windows = [w for w in (row.paused for row in self.workers.values()) if w is not None]
        if not windows:
            return None
        return min(w[0] for w in windows), max(w[1] for w in windows)

    def rows(self, order: str = "worker") -> list[WorkerRow]:
        """Its workers by id, or (``slowest``) by their longest phase, longest first."""
        rows = sorted(self.workers.values(), key=lambda r: r.worker_id)
        if order == "slowest":
            rows.sort(key=lambda r: -(r.longest.duration_s if r.longest else 0.0))
        return rows


_DRAWN_EVENTS = frozenset({"update_started", "phase_finished", "update_finished"})
"""With acks, what a timeline is drawn from. Commands are left out: some carry
an update id that names no update (a term's ``committed`` notice, a refusal)."""


def build_timelines(records: Iterable[TrailRecord]) -> list[UpdateTimeline]:
    """Every update the trail shows, in the order it first shows each."""
    timelines: dict[str, UpdateTimeline] = {}
    for record in records:
        message = record.message
        update_id = message.get("update_id")
        drawn = record.kind == "ack" or message.get("type") in _DRAWN_EVENTS
        if record.poison or not drawn or not isinstance(update_id, str) or not update_id:
            continue
        if not math.isfinite(record.ts):
            continue
        timeline = timelines.get(update_id)
        if timeline is None:
            timeline = timelines[update_id] = UpdateTimeline(update_id=update_id)
        _take(timeline, record.kind, message, record.ts)
    return list(timelines.values())


def _take(timeline: UpdateTimeline, kind: str, message: Mapping[str, Any], ts: float) -> None:
    kind_of = message.get("type")
    if kind == "ack":
        _take_ack(timeline, message, ts)
    elif kind_of == "update_started":
        timeline.started = ts
        timeline.adapter = str(message.get("adapter", ""))
        version = message.get("version")
        timeline.version = version if _is_int(version) else None
        for worker_id, size in _mapping(message.get("members")).items():
            _row(timeline, worker_id).world_size = size if _is_int(size) else 0
    elif kind_of == "phase_finished":
        duration = _seconds(message.get("duration_s"))
        ok = message.get("ok") is True
        failed = [str(w) for w in _list(message.get("failed"))]
        missing = [str(w) for w in _list(message.get("missing"))]
        why = "; ".join(
            part
            for part in (
                f"failed: {', '.join(failed)}" if failed else "",
                f"no answer: {', '.join(missing)}" if missing else "",
            )
            if part
        )
        phase = str(message.get("phase", "?"))
        timeline.coordinator.append(Bar(phase, ts - duration, ts, ok, why))
        for worker_id in missing:
            _row(timeline, worker_id).unanswered.append(PHASE_LABELS.get(phase, phase))
    elif kind_of == "update_finished":
        timeline.ended = ts
        timeline.status = str(message.get("status", ""))
        timeline.error = _error_text(message.get("error"))
        timeline.served_name = str(message.get("adapter", ""))
        rank_map = _mapping(message.get("rank_map"))
        for listed in _list(rank_map.get("entries")):
            entry = _mapping(listed)
            named, offset = entry.get("worker_id"), entry.get("rank_offset")
            if isinstance(named, str) and _is_int(offset):
                _row(timeline, named).rank_offset = offset


def _take_ack(timeline: UpdateTimeline, message: Mapping[str, Any], ts: float) -> None:
    worker_id = message.get("worker_id")
    if not isinstance(worker_id, str):
        return
    error_code = _mapping(message.get("error")).get("code")
    if error_code == "fenced":
        return  # a deposed leader's late command, refused: no failure of this worker
    row = _row(timeline, worker_id)
    if not row.world_size and _is_int(message.get("world_size")):
        row.world_size = message["world_size"]
    ok = message.get("ok") is True
    error = "" if ok else (_error_text(message.get("error")) or "failed")
    start = ts - _seconds(message.get("duration_s"))
    if message.get("with_pause") is True:
        # One ack for a pause and the load it carried: the pause ran first.
        paused_at = start - _seconds(message.get("pause_s"))
        row.bars.append(Bar("pause", paused_at, start))
    bar = Bar(str(message.get("phase", "?")), start, ts, ok, error)
    if bar not in row.bars:  # an ack sent again is the same bar
        row.bars.append(bar)


def _row(timeline: UpdateTimeline, worker_id: str) -> WorkerRow:
    row = timeline.workers.get(worker_id)
    if row is None:
        row = timeline.workers[worker_id] = WorkerRow(worker_id)
    return row


def _error_text(value: object) -> str:
    error = _mapping(value)
    code, message = error.get("code"), error.get("message")
    return ": ".join(str(part) for part in (code, message) if part)


def _seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if 0 <= value < 1e6 else 0.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []
