"""What each worker did in one update, and when, read from an audit trail.

The trail holds what the timeline needs already: the coordinator's
``update_started``, ``phase_finished`` (with its duration) and
``update_finished`` (with the rank map) events, and every agent's acks, each
stored when it was sent and carrying how long its phase took on that worker
(a load's ack that carries its pause carries the pause's time too). A bar is
``[stored - duration, stored]``: the agent's own clock for the length, the
stream's for the end, so that workers line up on one clock.

One bar per worker and phase of an update, from the first ack of that phase
in the trail: an agent answers a command sent again with the ack it already
sent (stored again, later), and the coordinator counts a worker's first ack.

A worker's engine is paused from its first ok pause ack on until something
resumes it, by the rule of ``audit verify`` (``unresumed_pause``): an ok
resume ack of any update, its agent's resume when the pause lease ran out
(``lease_expired``, resumed), or its agent's resume outside any update
(``engine_resumed``). A pause that nothing resumed, and an update with no
result, run to the end of the trail (its last record): what an operator most
needs to see is drawn, not lost as a window of no width.

Nothing read from the bus is trusted: a record that is not what lorabus
writes is skipped, never raised.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lorabus.audit.verify import DEFAULT_PREFIX, TrailRecord, workers_records
from lorabus.schemas.nodes import NodeRoster

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

    def held(self) -> dict[str, set[str]]:
        """worker -> the updates whose pause of its engine is still open."""
        return {w: {update_id for update_id, _, _ in opened} for w, opened in self._open.items()}

    def close_at_end(self, trail_end: float) -> None:
        """Whatever is still open was never resumed: it runs to the trail's end."""
        for opened in self._open.values():
            for _, row, start in opened:
                row.pause = PauseWindow(start, max(trail_end, start))
        self._open.clear()


def build_timelines(records: Iterable[TrailRecord]) -> list[UpdateTimeline]:
    """Every update the trail shows, in the order it first shows each."""
    builder = TimelineBuilder()
    for record in records:
        builder.take(record)
    return builder.timelines()


class TimelineBuilder:
    """Timelines built from records taken one at a time, in stream order,
    keeping nothing of a record but what it adds to them. ``draw``: the
    updates to draw (default all; the others' acks still end pauses);
    ``nodes``: the roster a node's acks are held to (``$LORABUS_NODES_FILE``'s);
    ``prefix``: the fleet's subject prefix, for who sent each record."""

    def __init__(
        self,
        draw: Container[str] | None = None,
        nodes: NodeRoster | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self._draw = draw
        self._nodes = nodes if nodes is not None else NodeRoster.from_env()
        self._prefix = prefix
        self._timelines: dict[str, UpdateTimeline] = {}
        self._pauses = _OpenPauses()
        self.trail_end: float | None = None
        """The latest time of a record taken."""
        self.poison = 0
        """Poison records taken (left out)."""

    def take(self, record: TrailRecord) -> None:
        """The next record of the trail."""
        for each in workers_records(record, self._nodes, self._prefix):
            self._take_one(each)

    def _take_one(self, record: TrailRecord) -> None:
        self.poison += bool(record.poison)
        if not math.isfinite(record.ts):
            return
        self.trail_end = record.ts if self.trail_end is None else max(self.trail_end, record.ts)
        update_id = _drawn_update(record)
        if update_id is None or (self._draw is not None and update_id not in self._draw):
            self.end_pauses(record)
            return
        timeline = self._timelines.get(update_id)
        if timeline is None:
            timeline = self._timelines[update_id] = UpdateTimeline(update_id=update_id)
        _take(timeline, self._pauses, record.kind, record.message, record.ts)

    def end_pauses(self, record: TrailRecord) -> None:
        """Only what ``record`` ends of the open pauses: an ok resume ack, or an
        agent's own resume (a record read to learn when an engine resumed)."""
        if (
            len(acks := workers_records(record, self._nodes, self._prefix)) != 1
            or acks[0] is not record
        ):
            for each in acks:
                self.end_pauses(each)
            return
        message = record.message
        if record.poison or not math.isfinite(record.ts):
            return
        if record.kind == "event" and message.get("type") in _RESUMING_EVENTS:
            _take_agent_resume(self._pauses, message, record.ts)
        elif record.kind == "ack" and _drawn_update(record) is not None:
            _take_resume_ack(self._pauses, message, record.ts)

    def open_pauses(self) -> dict[str, set[str]]:
        """The workers whose engine no record taken has resumed yet, each with
        the updates that paused it."""
        return self._pauses.held()

    def timelines(self, trail_end: float | None = None) -> list[UpdateTimeline]:
        """The updates drawn, in the order the records first show each. What is
        still open runs to ``trail_end`` (the trail's end; by default the last
        record taken)."""
        ends = [t for t in (trail_end, self.trail_end) if t is not None]
        end = max(ends) if ends else None
        if end is not None:
            self._pauses.close_at_end(end)
        for timeline in self._timelines.values():
            timeline.trail_end = end
        return list(self._timelines.values())


def _drawn_update(record: TrailRecord) -> str | None:
    """The update a record draws in (an ack, or an update's own event), if any."""
    message = record.message
    if record.poison:
        return None
    if record.kind == "event" and message.get("type") in _RESUMING_EVENTS:
        return None
    update_id = message.get("update_id")
    drawn = record.kind == "ack" or message.get("type") in _DRAWN_EVENTS
    return update_id if drawn and isinstance(update_id, str) and update_id else None


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
    _take_resume_ack(pauses, message, ts)


def _take_resume_ack(pauses: _OpenPauses, message: Mapping[str, Any], ts: float) -> None:
    """An ok resume ack resumes its worker's engine, whichever update paused
    it; one that says the engine is still paused (another update of its round
    holds the shared pause) ends only its own update's pause."""
    worker_id, this = message.get("worker_id"), message.get("update_id")
    if message.get("phase") != "resume" or message.get("ok") is not True:
        return
    if isinstance(worker_id, str) and isinstance(this, str):
        pauses.resume(
            worker_id,
            ts,
            lambda paused: "its resume" if paused == this else f"the resume of update {this}",
            only=this if message.get("paused") is True else None,
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
