"""What each worker did in one update, and when, read from an audit trail.

The trail holds what the timeline needs already: the coordinator's
``update_started``, ``phase_finished`` (with its duration) and
``update_finished`` (with the rank map) events, and every agent's acks, each
stored when it was sent and carrying how long its phase took on that worker
(a load's ack that carries its pause carries the pause's time too). A bar is
``[stored - duration, stored]``: the agent's own clock for the length, the
stream's for the end, so that workers line up on one clock.

One bar per worker and phase of an update, from the first ack of that phase
in the trail: an agent answers a command the coordinator sent again with the
ack it already sent, which the stream stores again, later; and the
coordinator counts a worker's first ack of a phase, so the first is the one
that ended it.

A worker's engine is paused from its first ok pause ack on until something
resumes it, by the rule of ``audit verify`` (``unresumed_pause``): an ok
resume ack of any update, its agent's resume when the pause lease ran out
(``lease_expired``, resumed), or its agent's resume outside any update
(``engine_resumed``). A pause that nothing resumed, and an update with no
result, run to the end of the trail (its last record): what an operator most
needs to see is drawn, not lost as a window of no width.

Everything here is data read from the bus, so nothing in it is trusted: a
record that is not what lorabus writes is skipped, never raised.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorabus.audit.verify import TrailRecord

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


@dataclass(frozen=True)
class PauseWindow:
    """From a worker's engine's pause to what resumed it."""

    start: float
    end: float
    """When it was resumed; for a pause nothing resumed, the trail's end."""
    resumed_by: str = ""
    """What resumed it, said for a person ("": nothing in the trail did)."""

    @property
    def resumed(self) -> bool:
        return bool(self.resumed_by)

    @property
    def duration_s(self) -> float:
        return self.end - self.start


@dataclass
class WorkerRow:
    worker_id: str
    world_size: int = 0
    rank_offset: int | None = None
    bars: list[Bar] = field(default_factory=list)
    """At most one per phase: the first ack of each."""
    unanswered: list[str] = field(default_factory=list)
    """Phases the coordinator gave up waiting for this worker in."""
    pause: PauseWindow | None = None
    """From its engine's pause in this update to its resume, as the trail tells it."""

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
    def unresumed(self) -> bool:
        """Its engine was paused and nothing in the trail resumed it."""
        return self.pause is not None and not self.pause.resumed


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
    trail_end: float | None = None
    """The time of the trail's last record: where what never ended is drawn to."""

    @property
    def unfinished(self) -> bool:
        """It started and the trail holds no result of it (its coordinator
        died, or it was still running when the trail was read)."""
        return self.started is not None and self.ended is None

    @property
    def active_span(self) -> tuple[float, float]:
        """The first and last instant a record of the update itself shows."""
        times = [t for t in (self.started, self.ended) if t is not None]
        for bar in self.coordinator:
            times += (bar.start, bar.end)
        for row in self.workers.values():
            for bar in row.bars:
                times += (bar.start, bar.end)
        return (min(times), max(times)) if times else (0.0, 0.0)

    @property
    def span(self) -> tuple[float, float]:
        """What is drawn: its records, its engines' pauses up to their resume
        (or the trail's end) and, with no result, up to the trail's end."""
        start, end = self.active_span
        ends = [row.pause.end for row in self.workers.values() if row.pause is not None]
        if self.unfinished and self.trail_end is not None:
            ends.append(self.trail_end)
        return start, max([end, *ends])

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
    def unresumed(self) -> list[WorkerRow]:
        """Its workers whose engine nothing in the trail resumed, by id."""
        return [row for row in self.rows() if row.unresumed]

    @property
    def pause_window(self) -> tuple[float, float] | None:
        """From the first engine's pause to the last one's resume (or the trail's end)."""
        windows = [row.pause for row in self.workers.values() if row.pause is not None]
        if not windows:
            return None
        return min(w.start for w in windows), max(w.end for w in windows)

    def rows(self, order: str = "worker") -> list[WorkerRow]:
        """Its workers by id, or (``slowest``) by their longest phase, longest first."""
        rows = sorted(self.workers.values(), key=lambda r: r.worker_id)
        if order == "slowest":
            rows.sort(key=lambda r: -(r.longest.duration_s if r.longest else 0.0))
        return rows


_DRAWN_EVENTS = frozenset({"update_started", "phase_finished", "update_finished"})
"""With acks, what a timeline is drawn from. Commands are left out: some carry
an update id that names no update (a term's ``committed`` notice, a refusal)."""
_RESUMING_EVENTS = frozenset({"lease_expired", "engine_resumed"})
"""An agent's own resume of its engine: it ends a pause, and draws nothing."""


class _OpenPauses:
    """The pauses no record has ended yet, per worker, across updates: a
    resume of any update resumes the engine (as ``audit verify`` rules)."""

    def __init__(self) -> None:
        self._open: dict[str, list[tuple[str, WorkerRow, float]]] = {}
        """worker -> (update id, its row, when it paused) of each open pause."""

    def open(self, update_id: str, row: WorkerRow, at: float) -> None:
        """The engine of ``row`` paused at ``at``, unless this update paused it before."""
        if row.pause is None:
            row.pause = PauseWindow(start=at, end=at)
            self._open.setdefault(row.worker_id, []).append((update_id, row, at))

    def resume(
        self,
        worker_id: str,
        at: float,
        how: Callable[[str], str],
        only: str | None = None,
    ) -> None:
        """The engine of ``worker_id`` resumed at ``at``: its open pauses (of
        update ``only``, if given) end there; ``how(update_id)`` says how."""
        left = []
        for update_id, row, start in self._open.pop(worker_id, []):
            if only is not None and update_id != only:
                left.append((update_id, row, start))
            else:
                row.pause = PauseWindow(start, max(at, start), how(update_id))
        if left:
            self._open[worker_id] = left

    def close_at_end(self, trail_end: float) -> None:
        """Whatever is still open was never resumed: it runs to the trail's end."""
        for opened in self._open.values():
            for _, row, start in opened:
                row.pause = PauseWindow(start, max(trail_end, start))
        self._open.clear()


def build_timelines(records: Iterable[TrailRecord]) -> list[UpdateTimeline]:
    """Every update the trail shows, in the order it first shows each."""
    timelines: dict[str, UpdateTimeline] = {}
    pauses = _OpenPauses()
    trail_end: float | None = None
    for record in records:
        if not math.isfinite(record.ts):
            continue
        trail_end = record.ts if trail_end is None else max(trail_end, record.ts)
        message = record.message
        update_id = message.get("update_id")
        if record.poison:
            continue
        if record.kind == "event" and message.get("type") in _RESUMING_EVENTS:
            _take_agent_resume(pauses, message, record.ts)
            continue
        drawn = record.kind == "ack" or message.get("type") in _DRAWN_EVENTS
        if not drawn or not isinstance(update_id, str) or not update_id:
            continue
        timeline = timelines.get(update_id)
        if timeline is None:
            timeline = timelines[update_id] = UpdateTimeline(update_id=update_id)
        _take(timeline, pauses, record.kind, message, record.ts)
    if trail_end is not None:
        pauses.close_at_end(trail_end)
    for timeline in timelines.values():
        timeline.trail_end = trail_end
    return list(timelines.values())


def _take(
    timeline: UpdateTimeline,
    pauses: _OpenPauses,
    kind: str,
    message: Mapping[str, Any],
    ts: float,
) -> None:
    kind_of = message.get("type")
    if kind == "ack":
        _take_ack(timeline, pauses, message, ts)
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


def _take_ack(
    timeline: UpdateTimeline, pauses: _OpenPauses, message: Mapping[str, Any], ts: float
) -> None:
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
    phase = str(message.get("phase", "?"))
    if message.get("with_pause") is True:
        # One ack for a pause and the load it carried: the pause ran first.
        paused_at = start - _seconds(message.get("pause_s"))
        _first_of_phase(row, Bar("pause", paused_at, start))
        pauses.open(timeline.update_id, row, start)
    _first_of_phase(row, Bar(phase, start, ts, ok, error))
    if phase == "pause" and ok:
        pauses.open(timeline.update_id, row, ts)
    elif phase == "resume" and ok:
        this = timeline.update_id
        pauses.resume(
            worker_id,
            ts,
            lambda paused: "its resume" if paused == this else f"the resume of update {this}",
        )


def _first_of_phase(row: WorkerRow, bar: Bar) -> None:
    """Add ``bar`` unless an ack of its phase came before: an ack sent again
    (for a command sent again) is stored again, later, and ends nothing."""
    if all(drawn.phase != bar.phase for drawn in row.bars):
        row.bars.append(bar)


def _take_agent_resume(pauses: _OpenPauses, message: Mapping[str, Any], ts: float) -> None:
    """An agent resumed its engine itself: at its start or stop (any pause of
    it ends), or when the lease of an update's pause ran out (that pause ends,
    if the resume worked)."""
    worker_id = message.get("worker_id")
    if not isinstance(worker_id, str):
        return
    if message.get("type") == "engine_resumed":
        reason = str(message.get("reason", "")) or "on its own"
        pauses.resume(worker_id, ts, lambda _: f"its agent ({reason})")
        return
    update_id = message.get("update_id")
    if message.get("resumed") is True and isinstance(update_id, str):
        lease = "its agent, when its pause lease ran out"
        pauses.resume(worker_id, ts, lambda _: lease, only=update_id)


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
