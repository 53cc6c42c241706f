"""One self-contained HTML page of update timelines (``lorabus audit timeline``).

Nothing is fetched from anywhere (no script, font or stylesheet from a URL):
the page opens on an air-gapped machine. Bars are plain elements placed by
percentages of the update's span, so no script is needed to draw them.
A pause that nothing resumed, and an update with no result, are drawn up to
the trail's end and marked ("never resumed", "no result in the trail"): the
case an operator most needs to see must not be a window of no width.
Every text comes from the trail, which anyone on the bus could have written
into: all of it is escaped.
"""

from __future__ import annotations

import contextlib
import html
import time
from collections.abc import Sequence

from lorabus.audit.timeline import Bar, UpdateTimeline, WorkerRow

_STYLE = """
body { font: 13px/1.35 system-ui, sans-serif; margin: 16px; color: #222; }
h1 { font-size: 18px; } h2 { font-size: 15px; margin: 24px 0 4px; }
.summary { margin: 2px 0 8px; } .summary b { font-weight: 600; }
.failed-text { color: #b00020; font-weight: 600; margin: 4px 0; }
.failed-list { color: #b00020; margin: 0 0 8px; }
.legend span { display: inline-block; padding: 0 6px; margin-right: 4px; color: #fff; }
.rows { max-height: 75vh; overflow-y: auto; border: 1px solid #ddd; }
.row { display: flex; align-items: center; height: 18px; border-bottom: 1px solid #f2f2f2; }
.row.head { position: sticky; top: 0; background: #fafafa; z-index: 2; font-weight: 600; }
.row.coordinator { background: #f5f7fb; }
.row.unresumed { background: #fff1e0; }
.row.failed { background: #fde8ea; }
.label { width: 330px; flex: none; padding: 0 6px; white-space: nowrap; overflow: hidden;
         text-overflow: ellipsis; font-variant-numeric: tabular-nums; }
.label .ws, .label .rank { display: inline-block; width: 52px; color: #555; }
.label .id { display: inline-block; width: 120px; }
.track { position: relative; flex: 1; height: 14px; }
.bar { position: absolute; top: 2px; height: 10px; min-width: 2px; border-radius: 2px; }
.bar.not-ok { background: #d0021b !important; outline: 2px solid #7a0010; }
.window { position: absolute; top: 0; height: 14px; background: rgba(201,162,39,.18);
          border-left: 1px solid #c9a227; border-right: 1px solid #c9a227; }
.window.open { background: rgba(230,81,0,.22); border-right: 3px dashed #e65100; }
.window.unfinished { background: rgba(120,120,120,.15); border-left-color: #777; }
.badge { font-size: 11px; padding: 0 4px; border-radius: 3px; margin-left: 4px; color: #fff; }
.badge.slowest { background: #6a3d9a; } .badge.failed { background: #d0021b; }
.badge.unresumed { background: #e65100; }
.phase-quorum { background: #9e9e9e; } .phase-prepare { background: #8e6c8a; }
.phase-pause { background: #c9a227; } .phase-load { background: #2a7ab9; }
.phase-verify { background: #17a2b8; } .phase-resume { background: #3b9c5b; }
.phase-canary { background: #d9822b; } .phase-unload { background: #777; }
.axis { display: flex; justify-content: space-between; margin-left: 330px; color: #666; }
"""
_LISTED = 20
"""Failed members listed with their errors under an update's summary."""
_PHASES = ("quorum", "prepare", "pause", "load", "verify", "resume", "canary", "unload")


def render_page(
    timelines: Sequence[UpdateTimeline], *, order: str = "worker", notes: Sequence[str] = ()
) -> str:
    """The page for ``timelines``; ``notes`` are shown at the top (records left out)."""
    sections = "\n".join(_section(t, order, _beside(t, timelines)) for t in timelines)
    legend = "".join(f'<span class="phase-{p}">{_e(Bar(p, 0, 0).label)}</span>' for p in _PHASES)
    shown = "".join(f'<p class="note">{_e(note)}</p>' for note in notes)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>lorabus update timeline</title><style>{_STYLE}</style></head><body>"
        f"<h1>lorabus: {len(timelines)} update(s)</h1>{shown}"
        f'<p class="legend">{legend} <span style="background:#d0021b">failed</span> '
        '<span style="background:rgba(201,162,39,.45);color:#222">paused</span> '
        '<span style="background:rgba(230,81,0,.45);color:#222" '
        'title="paused, and nothing in the trail resumed it: drawn to the trail\'s end">'
        "never resumed</span></p>"
        f"{sections}</body></html>\n"
    )


def _beside(timeline: UpdateTimeline, timelines: Sequence[UpdateTimeline]) -> list[str]:
    """The other updates that ran while this one did (updates of different
    adapters run at once): each section has its own time axis, so the page
    says which overlap. O(n^2) in the updates drawn, a few hundred at most."""
    start, end = timeline.active_span
    return [
        other.served_name or other.adapter or other.update_id
        for other in timelines
        if other is not timeline and other.active_span[0] < end and start < other.active_span[1]
    ]


def _section(timeline: UpdateTimeline, order: str, beside: Sequence[str] = ()) -> str:
    scale = _Scale(timeline)
    slowest = timeline.slowest
    slowest_id = slowest[0] if slowest else None
    took, in_flight = _took(timeline, scale)
    rows = [
        '<div class="row head"><div class="label"><span class="id">worker</span>'
        '<span class="ws">size</span><span class="rank">rank</span>phases</div>'
        '<div class="track"></div></div>',
        '<div class="row coordinator"><div class="label"><span class="id">coordinator</span>'
        '</div><div class="track">'
        + in_flight
        + "".join(scale.bar(b) for b in timeline.coordinator)
        + "</div></div>",
    ]
    for row in timeline.rows(order):
        rows.append(_worker_row(row, scale, row.worker_id == slowest_id))
    ticks = "".join(f"<span>{_ms(scale.width * k / 4)}</span>" for k in range(5))
    return (
        f'<section class="update" id="update-{_e(timeline.update_id)}">'
        f"<h2>update {_e(timeline.update_id)}</h2>"
        f'<p class="summary">{" · ".join(_facts(timeline, took, beside))}</p>'
        f"{_problems(timeline)}"
        f'<div class="axis">{ticks}</div>'
        f'<div class="rows">{"".join(rows)}</div></section>'
    )


class _Scale:
    """Where an instant of an update falls on its rows: a share of its span."""

    def __init__(self, timeline: UpdateTimeline) -> None:
        self.t0, t1 = timeline.span
        self.width = max(t1 - self.t0, 1e-3)

    def place(self, start: float, end: float) -> str:
        left = (start - self.t0) / self.width * 100
        width = max(end - start, 0.0) / self.width * 100
        return f"left:{left:.3f}%;width:{width:.3f}%"

    def bar(self, b: Bar) -> str:
        title = f"{b.label} {_ms(b.duration_s)}" + (f": {b.error}" if b.error else "")
        state = "" if b.ok else " not-ok"
        return (
            f'<div class="bar phase-{_e(_phase_class(b.phase))}{state}" '
            f'style="{self.place(b.start, b.end)}" title="{_e(title)}"></div>'
        )


def _took(timeline: UpdateTimeline, scale: _Scale) -> tuple[str, str]:
    """How long the update took, and the band of one still in flight when
    the trail ends ("" when it ended)."""
    a0, a1 = timeline.active_span
    took = f"took {_ms(a1 - a0)}"
    if not timeline.unfinished or timeline.started is None or timeline.trail_end is None:
        return took, ""
    ran = max(timeline.trail_end - timeline.started, 0.0)
    took = f"still in flight when the trail ends, {_ms(ran)} after its start"
    band = (
        f'<div class="window open unfinished" '
        f'style="{scale.place(timeline.started, timeline.started + ran)}" '
        f'title="{_e(f"no result in the trail: {took}")}"></div>'
    )
    return took, band


def _facts(timeline: UpdateTimeline, took: str, beside: Sequence[str] = ()) -> list[str]:
    """The update's summary line, part by part."""
    facts = [
        f"<b>{_e(timeline.status or 'no result in the trail')}</b>",
        f"adapter {_e(timeline.adapter)}"
        + (f" v{timeline.version}" if timeline.version is not None else ""),
        f"{len(timeline.workers)} worker(s)",
        took,
    ]
    if timeline.started is not None:
        with contextlib.suppress(OverflowError, OSError, ValueError):  # a time of no calendar
            facts.append(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(timeline.started)))
    pause = timeline.pause_window
    if pause is not None:
        to_end = " (to the end of the trail)" if timeline.unresumed else ""
        facts.append(f"engines paused for {_ms(pause[1] - pause[0])}{to_end}")
    slowest = timeline.slowest
    if slowest is not None:
        facts.append(
            f"slowest: {_e(slowest[0])}, {_e(slowest[1].label)} {_ms(slowest[1].duration_s)}"
        )
    if beside:
        shown = ", ".join(beside[:_LISTED]) + (
            f" and {len(beside) - _LISTED} more" if len(beside) > _LISTED else ""
        )
        facts.append(f"ran beside {_e(shown)}")
    return facts


def _problems(timeline: UpdateTimeline) -> str:
    """The update's error, its engines never resumed and its failed members."""
    problems = ""
    if timeline.error:
        problems += f'<p class="failed-text">{_e(timeline.error)}</p>'
    unresumed = timeline.unresumed
    if unresumed:
        named = ", ".join(r.worker_id for r in unresumed[:_LISTED])
        more = f" and {len(unresumed) - _LISTED} more" if len(unresumed) > _LISTED else ""
        problems += (
            f'<p class="failed-text">engine(s) never resumed: {_e(named)}{more} '
            "(paused to the end of the trail)</p>"
        )
    failed = timeline.failed
    if failed:
        items = "".join(f"<li>{_e(r.worker_id)}: {_e(r.error)}</li>" for r in failed[:_LISTED])
        more = f"<li>and {len(failed) - _LISTED} more</li>" if len(failed) > _LISTED else ""
        problems += (
            f'<p class="failed-text">failed member(s): {len(failed)}</p>'
            f'<ul class="failed-list">{items}{more}</ul>'
        )
    return problems


def _worker_row(row: WorkerRow, scale: _Scale, slowest: bool) -> str:
    error = row.error
    badges = ""
    if slowest:
        badges += '<span class="badge slowest">slowest</span>'
    if error:
        badges += f'<span class="badge failed" title="{_e(error)}">failed</span>'
    band = ""
    window = row.pause
    if window is not None and window.resumed:
        band = (
            f'<div class="window" style="{scale.place(window.start, window.end)}" '
            f'title="{_e(f"engine paused {_ms(window.duration_s)}, until {window.resumed_by}")}">'
            "</div>"
        )
    elif window is not None:
        never = (
            f"engine paused, never resumed: still paused when the trail ends, "
            f"{_ms(window.duration_s)} after its pause"
        )
        band = (
            f'<div class="window open" style="{scale.place(window.start, window.end)}" '
            f'title="{_e(never)}"></div>'
        )
        badges += f'<span class="badge unresumed" title="{_e(never)}">never resumed</span>'
    rank = "" if row.rank_offset is None else str(row.rank_offset)
    label = (
        f'<span class="id">{_e(row.worker_id)}</span><span class="ws">{row.world_size or ""}'
        f'</span><span class="rank">{rank}</span>{badges}'
        + (f' <span class="failed-text">{_e(error)}</span>' if error else "")
    )
    css = "row worker" + (" unresumed" if row.unresumed else "") + (" failed" if error else "")
    return (
        f'<div class="{css}" data-worker="{_e(row.worker_id)}">'
        f'<div class="label" title="{_e(row.worker_id)}">{label}</div>'
        f'<div class="track">{band}{"".join(scale.bar(b) for b in row.bars)}</div></div>'
    )


def _phase_class(phase: str) -> str:
    return phase if phase in _PHASES else "other"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)
