"""The update timeline draws what happened once, and what never ended to the
end of the trail (issue 38).

An agent answers a re-sent command with the ack it already sent: the trail
then holds the same ack twice, stored later, and the timeline must not draw
a second, shifted bar. A worker that acked a pause and that nothing resumed
(the coordinator died, its resume failed) is drawn paused up to the trail's
last record and marked "never resumed", where it used to get a window of
no width: by the same rule as ``audit verify``'s ``unresumed_pause``, so the
page and the verdict name the same workers. An update with no result is
drawn as in flight up to the trail's end, likewise.

Trails are built from the wire's own message types, each stored at a time
given by hand: nothing here waits or reads a clock.
"""

from __future__ import annotations

import re

import msgspec
import pytest

from lorabus.audit.timeline import Bar, PauseWindow, build_timelines
from lorabus.audit.timeline_page import render_page
from lorabus.audit.verify import TrailRecord, origin_of, verify
from lorabus.schemas import (
    Ack,
    EngineResumed,
    ErrorCode,
    ErrorInfo,
    LeaseExpired,
    MemberAlert,
    Phase,
    PhaseFinished,
    Subjects,
    UpdateFinished,
    UpdateStarted,
    build_rank_map,
    tag_of,
    to_builtins,
)

SUBJECTS = Subjects(fleet="f")
MEMBERS = {"a": 2, "b": 1, "c": 1, "d": 1}


def _subject(message: msgspec.Struct) -> str:
    """The subject an honest sender publishes ``message`` on."""
    if isinstance(message, Ack):
        return SUBJECTS.ack(message.worker_id)
    source = getattr(message, "source", "coordinator")
    if source == "coordinator":
        return SUBJECTS.coordinator_event(tag_of(message))
    return SUBJECTS.agent_event(source.removeprefix("agent:"), tag_of(message))


def _trail(*stored: tuple[float, msgspec.Struct]) -> list[TrailRecord]:
    """Records of ``(time the stream stored it, message)``, in stream order."""
    records = []
    for seq, (ts, message) in enumerate(stored, start=1):
        subject = _subject(message)
        records.append(
            TrailRecord(
                seq=seq,
                subject=subject,
                ts=ts,
                kind=origin_of(subject).kind,
                message=to_builtins(message),
            )
        )
    return records


def _ack(
    worker: str,
    phase: Phase,
    took: float,
    *,
    update: str = "u1",
    ok: bool = True,
    error: ErrorInfo | None = None,
    epoch: int = 1,
    with_pause: float | None = None,
) -> Ack:
    return Ack(
        update_id=update,
        phase=phase,
        worker_id=worker,
        ok=ok,
        world_size=MEMBERS[worker],
        adapters=[],
        paused=phase in (Phase.PAUSE, Phase.LOAD),
        error=error,
        duration_s=took,
        epoch=epoch,
        instance=f"i-{worker}",
        with_pause=with_pause is not None,
        pause_s=with_pause or 0.0,
    )


def _started(update: str = "u1", members: dict[str, int] = MEMBERS) -> UpdateStarted:
    return UpdateStarted(
        ts=0.0,
        source="coordinator",
        update_id=update,
        adapter="policy",
        version=1,
        members=members,
        epoch=1,
    )


def _finished(update: str = "u1", members: dict[str, int] = MEMBERS) -> UpdateFinished:
    return UpdateFinished(
        ts=0.0,
        source="coordinator",
        update_id=update,
        status="committed",
        adapter="policy-v1",
        rank_map=build_rank_map(members),
        epoch=1,
    )


_PLAIN = {"with_pause": False, "pause_s": 0.0, "digest": ""}
"""What turns a load's ack that carries its pause into the pause's own ack,
as the agent remembers it (``acks_in``)."""


def _spans(bars: list[Bar]) -> dict[str, tuple[float, float, bool]]:
    spans = {}
    for bar in bars:
        assert bar.phase not in spans, f"a second {bar.phase} bar: {bars}"
        spans[bar.phase] = (round(bar.start, 6), round(bar.end, 6), bar.ok)
    return spans


def _legend(page: str) -> str:
    found = re.search(r'<p class="legend">(.*?)</p>', page, re.S)
    assert found is not None, page
    return found.group(1)


def _sections(page: str) -> str:
    return page.split("<section", 1)[1]


def _row_html(page: str, worker: str) -> str:
    found = re.search(rf'<div class="[^"]*" data-worker="{worker}">(.*?)</div></div>', page, re.S)
    assert found is not None, page
    return found.group(0)


def test_an_ack_sent_again_draws_no_second_bar() -> None:
    """``a`` acks each phase and then, for a re-sent command, again; ``b``
    acks its pause inside its load's ack, then its pause again on its own and
    its load again (as the agent remembers them); ``c``'s load is refused
    first and loaded at a second try: the bar is the first ack's, as the
    coordinator counts only the first ack of a worker in a phase."""
    not_paused = ErrorInfo(code=ErrorCode.NOT_PAUSED, message="its pause did not hold")
    load_b = _ack("b", Phase.LOAD, 0.5, with_pause=0.3)
    trail = _trail(
        (10.0, _started(members={"a": 2, "b": 1, "c": 1})),
        (10.2, _ack("a", Phase.PAUSE, 0.1)),
        (10.7, _ack("a", Phase.PAUSE, 0.1)),
        (11.0, load_b),
        (11.2, msgspec.structs.replace(load_b, phase=Phase.PAUSE, duration_s=0.3, **_PLAIN)),
        (11.3, msgspec.structs.replace(load_b, with_pause=False, pause_s=0.0)),
        (11.4, _ack("a", Phase.LOAD, 0.4)),
        (11.9, _ack("a", Phase.LOAD, 0.4)),
        (12.0, _ack("c", Phase.PAUSE, 0.1)),
        (12.1, _ack("c", Phase.LOAD, 0.0, ok=False, error=not_paused)),
        (12.6, _ack("c", Phase.LOAD, 0.2)),
        (13.0, _ack("a", Phase.RESUME, 0.1)),
        (13.1, _ack("b", Phase.RESUME, 0.1)),
        (13.2, _ack("c", Phase.RESUME, 0.1)),
        (13.5, _ack("a", Phase.RESUME, 0.1)),
        (14.0, _finished(members={"a": 2, "b": 1, "c": 1})),
    )

    (timeline,) = build_timelines(trail)
    page = render_page([timeline])

    rows = timeline.workers
    assert _spans(rows["a"].bars) == {
        "pause": (10.1, 10.2, True),
        "load": (11.0, 11.4, True),
        "resume": (12.9, 13.0, True),
    }
    assert _spans(rows["b"].bars) == {
        "pause": (10.2, 10.5, True),
        "load": (10.5, 11.0, True),
        "resume": (13.0, 13.1, True),
    }
    assert _spans(rows["c"].bars)["load"] == (12.1, 12.1, False)
    assert rows["a"].pause == PauseWindow(start=10.2, end=13.0, resumed_by="its resume")
    assert rows["b"].pause is not None and rows["b"].pause.start == pytest.approx(10.5)
    assert timeline.unresumed == []
    for worker in ("a", "b"):
        drawn = re.findall(r'class="bar phase-(\w+)', _row_html(page, worker))
        assert sorted(drawn) == ["load", "pause", "resume"], drawn


def test_a_pause_never_resumed_is_drawn_to_the_end_of_the_trail_and_marked() -> None:
    """The coordinator dies after the pause: no resume, no result. ``a`` and
    ``b`` are drawn paused up to the trail's last record (an alert of the
    fleet, 20 s on) and marked, as ``audit verify`` reports them; the update
    is drawn in flight up to there."""
    members = {"a": 2, "b": 1}
    trail = _trail(
        (10.0, _started(members=members)),
        (10.2, _ack("a", Phase.PAUSE, 0.1)),
        (10.8, _ack("b", Phase.LOAD, 0.5, with_pause=0.2)),
        (11.0, _ack("a", Phase.LOAD, 0.5)),
        (
            30.0,
            MemberAlert(
                ts=0.0,
                source="coordinator",
                worker_id="a",
                condition="paused_outside_update",
                reason="paused for 3 s while no update is in flight",
            ),
        ),
    )

    (timeline,) = build_timelines(trail)
    page = render_page([timeline])

    assert timeline.trail_end == 30.0
    a, b = timeline.workers["a"], timeline.workers["b"]
    assert a.pause == PauseWindow(start=10.2, end=30.0)
    assert b.pause == PauseWindow(start=pytest.approx(10.3), end=30.0)
    assert not a.pause.resumed and a.pause.duration_s == pytest.approx(19.8)
    assert [row.worker_id for row in timeline.unresumed] == ["a", "b"]
    assert timeline.pause_window == (10.2, 30.0)
    assert timeline.span == (pytest.approx(10.0), 30.0)
    assert timeline.unfinished
    unresumed = {v.message.split()[0] for v in verify(trail) if v.rule == "unresumed_pause"}
    assert unresumed == {"a", "b"}, "the page and audit verify name the same workers"

    for worker in ("a", "b"):
        row = _row_html(page, worker)
        assert 'class="row worker unresumed"' in row
        assert '<span class="badge unresumed"' in row and "never resumed" in row
        window = re.search(r'<div class="window open" style="left:([\d.]+)%;width:([\d.]+)%"', row)
        assert window is not None, row
        assert float(window.group(1)) + float(window.group(2)) == pytest.approx(100.0, abs=0.01)
    assert "engine(s) never resumed: a, b" in page
    assert 'class="window open unfinished"' in page and "no result in the trail" in page
    assert "never resumed" in _legend(page), "the legend says what the mark means"


def test_a_pause_ends_where_the_engine_was_resumed_whoever_resumed_it() -> None:
    """A failed resume leaves the engine paused; its agent's resume when the
    lease ran out ends the pause (``a``), as does an agent's resume at its
    restart (``b``) and a later update's resume (``c``). Only ``d``, whose
    lease expiry could not resume it, is never resumed: as ``audit verify``
    says."""
    failed = ErrorInfo(code=ErrorCode.ENGINE_ERROR, message="resume timed out")
    trail = _trail(
        (10.0, _started()),
        (10.1, _ack("a", Phase.PAUSE, 0.1)),
        (10.2, _ack("b", Phase.PAUSE, 0.1)),
        (10.3, _ack("c", Phase.PAUSE, 0.1)),
        (10.4, _ack("d", Phase.PAUSE, 0.1)),
        (12.0, _ack("a", Phase.RESUME, 1.0, ok=False, error=failed)),
        (
            40.0,
            LeaseExpired(ts=0.0, source="agent:a", update_id="u1", worker_id="a", resumed=True),
        ),
        (
            45.0,
            LeaseExpired(ts=0.0, source="agent:d", update_id="u1", worker_id="d", resumed=False),
        ),
        (50.0, EngineResumed(ts=0.0, source="agent:b", worker_id="b", reason="agent start")),
        (60.0, _started("u2", {"c": 1})),
        (60.5, _ack("c", Phase.PAUSE, 0.1, update="u2")),
        (61.0, _ack("c", Phase.RESUME, 0.1, update="u2")),
        (61.5, _finished("u2", {"c": 1})),
    )

    u1, u2 = build_timelines(trail)
    page = render_page([u1])

    assert {w: row.pause for w, row in u1.workers.items()} == {
        "a": PauseWindow(
            start=10.1, end=40.0, resumed_by="its agent, when its pause lease ran out"
        ),
        "b": PauseWindow(start=10.2, end=50.0, resumed_by="its agent (agent start)"),
        "c": PauseWindow(start=10.3, end=61.0, resumed_by="the resume of update u2"),
        "d": PauseWindow(start=10.4, end=61.5),
    }
    assert u2.workers["c"].pause == PauseWindow(start=60.5, end=61.0, resumed_by="its resume")
    assert [row.worker_id for row in u1.unresumed] == ["d"]
    assert [v.message.split()[0] for v in verify(trail) if v.rule == "unresumed_pause"] == ["d"]
    assert _spans(u1.workers["a"].bars)["resume"] == (11.0, 12.0, False)
    assert "until its agent, when its pause lease ran out" in _row_html(page, "a")
    assert "unresumed" not in _row_html(page, "c")


def test_an_update_with_a_result_is_not_drawn_in_flight() -> None:
    """Only an update with no result runs to the trail's end: a later
    update's records stretch no finished one, whose engines were resumed."""
    trail = _trail(
        (10.0, _started(members={"a": 2})),
        (10.2, _ack("a", Phase.PAUSE, 0.1)),
        (10.4, _ack("a", Phase.RESUME, 0.1)),
        (
            10.5,
            PhaseFinished(
                ts=0.0,
                source="coordinator",
                update_id="u1",
                phase=Phase.RESUME,
                ok=True,
                duration_s=0.2,
            ),
        ),
        (10.6, _finished(members={"a": 2})),
        (99.0, _started("u2", {"a": 2})),
    )

    u1, u2 = build_timelines(trail)
    page = render_page([u1])

    assert not u1.unfinished and u2.unfinished
    assert u1.span == (10.0, 10.6), "a later update's records do not stretch this one"
    assert "unfinished" not in _sections(page) and "never resumed" not in _sections(page)


def test_a_shared_pause_is_drawn_to_each_updates_own_resume_and_overlaps_are_named() -> None:
    """Two updates of a round share ``a``'s pause: the first's resume is held
    (its ack says the engine stays paused for the other), so only its own
    pause ends there; the second's resume ends the second's. Each section
    names the update that ran beside it (every section has its own axis)."""
    held = msgspec.structs.replace(_ack("a", Phase.RESUME, 0.1, update="u1"), paused=True)
    other = msgspec.structs.replace(_finished("u2", {"a": 2}), adapter="other-v1")
    trail = _trail(
        (10.0, _started("u1", {"a": 2})),
        (10.0, _started("u2", {"a": 2})),
        (10.1, _ack("a", Phase.PAUSE, 0.1, update="u1")),
        (10.2, _ack("a", Phase.PAUSE, 0.1, update="u2")),
        (11.0, held),
        (11.1, _finished("u1", {"a": 2})),
        (12.0, _ack("a", Phase.RESUME, 0.1, update="u2")),
        (12.1, other),
        (30.0, _started("u3", {"a": 2})),
        (30.5, _finished("u3", {"a": 2})),
    )

    u1, u2, u3 = build_timelines(trail)
    page = render_page([u1, u2, u3])

    assert u1.workers["a"].pause == PauseWindow(start=10.1, end=11.0, resumed_by="its resume")
    assert u2.workers["a"].pause == PauseWindow(start=10.2, end=12.0, resumed_by="its resume")
    assert not [v for v in verify(trail) if v.rule == "unresumed_pause"]
    sections = page.split("<section")[1:]
    assert "ran beside other-v1" in sections[0] and "ran beside policy-v1" in sections[1]
    assert "ran beside" not in sections[2], "u3 ran alone"
