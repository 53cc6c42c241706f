"""A phase's deadline rule (``coordinator/deadline.py``) over every case that
once broke it, in milliseconds and without a network.

Four fixes in one day came each from a real-time test that blocks the
process against a real server (``test_coordinator_stall.py``, which stays
as the end-to-end proof): a stall taken for the members' silence, a loop
that spun on an overdue re-send, acks read only after a deadline that
passed in a stall, and the same with a stall that ended just before the
deadline (which had no test). Here the rule is checked step by step
(``next_wake``, ``woke``); then whole phases are played on a timeline of
stalls, acks and heartbeats (:func:`play`, which drives the rule as
``phases.py`` does); then the real coordinator and agents run on the
in-memory bus under looptime, stalled as a process sees a stall: the
loop's clock jumps while nothing runs (:class:`StallingClock`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import pytest
from memory_fleet import InMemoryFleet

from lorabus.agents.bus import AgentBus
from lorabus.coordinator.deadline import (
    LIVENESS_TICK_S,
    STALL_S,
    PhaseDeadline,
    Wake,
    first_resend_gap,
)
from lorabus.coordinator.membership import MISSED_BEATS
from lorabus.schemas import Ack

TICK = LIVENESS_TICK_S
STALL = STALL_S
BUDGET_S = 30.0
START = PhaseDeadline.starting(0.0, BUDGET_S)
"""Deadline at 30 s, first re-send at 3.75 s (an eighth of the budget)."""
LATE = replace(START, next_resend=56.25, resend_gap=30.0)
"""Past its last re-send (at 3.75, 11.25 and 26.25 s)."""
OVERTIME = replace(LATE, deadline=30.0 + TICK, give_up_from=30.0 + TICK, overtime=True)
"""After a stall that ended at the deadline."""


def _wake(give_up_gone: bool, end: bool = False, resend_all: bool = False) -> Wake:
    return Wake(give_up_gone=give_up_gone, end=end, resend_all=resend_all)


READ_ONLY = _wake(False)


def test_a_phase_starts_with_its_budget_and_its_first_resend_an_eighth_of_it() -> None:
    assert START == PhaseDeadline(
        deadline=30.0, next_resend=3.75, resend_gap=3.75, give_up_from=0.0
    )
    assert first_resend_gap(2.0) == 1.0, "at least a second"


@pytest.mark.parametrize(
    ("times", "at", "wake_at"),
    [
        pytest.param(START, 0.0, TICK, id="a-tick-on"),
        pytest.param(START, 3.6, 3.75, id="at-the-resend"),
        pytest.param(LATE, 29.9, 30.0, id="at-the-deadline"),
        pytest.param(LATE, 30.0, None, id="deadline-now-ends"),
        pytest.param(LATE, 31.0, None, id="deadline-past-ends"),
        pytest.param(START, 5.0, 5.0, id="an-overdue-resend-now-never-in-the-past"),
        pytest.param(OVERTIME, 30.1, 30.0 + TICK, id="overtime-at-its-end"),
        pytest.param(
            replace(OVERTIME, next_resend=20.0), 30.1, 30.1, id="overtime-resend-overdue-now"
        ),
    ],
)
def test_when_a_phase_wakes_next(times: PhaseDeadline, at: float, wake_at: float | None) -> None:
    assert times.next_wake(at) == wake_at


def _moved(to: float) -> PhaseDeadline:
    return replace(LATE, deadline=to, give_up_from=to, overtime=True)


@pytest.mark.parametrize(
    ("times", "planned", "at", "wake", "after"),
    [
        # A tick that wakes late: by up to STALL_S it is no stall; later, by a
        # tick too (a wait of up to a tick before it would hide a stall of two).
        pytest.param(START, 1.0, 1.0, _wake(True), START, id="on-time"),
        pytest.param(START, 1.0, 1.0 + STALL / 2, _wake(True), START, id="late-by-a-hair-no-stall"),
        pytest.param(
            START,
            1.0,
            1.0 + TICK,
            READ_ONLY,
            replace(START, give_up_from=1.0 + 2 * TICK),
            id="late-by-a-tick-a-stall",
        ),
        pytest.param(
            START,
            1.0,
            1.26,
            READ_ONLY,
            replace(START, give_up_from=1.26 + TICK),
            id="later-a-stall-gives-nobody-up-for-a-tick",
        ),
        pytest.param(
            replace(START, give_up_from=2.0),
            1.9,
            1.9,
            READ_ONLY,
            replace(START, give_up_from=2.0),
            id="within-the-tick-after-a-stall",
        ),
        pytest.param(
            replace(START, give_up_from=2.0),
            2.0,
            2.0,
            _wake(True),
            replace(START, give_up_from=2.0),
            id="once-the-tick-after-a-stall-is-over",
        ),
        # The re-sends.
        pytest.param(
            START,
            3.75,
            3.75,
            _wake(True, resend_all=True),
            replace(START, next_resend=3.75 + 7.5, resend_gap=7.5),
            id="resend-due-gap-doubles",
        ),
        pytest.param(
            START,
            3.5,
            5.0,
            _wake(False, resend_all=True),
            replace(START, next_resend=5.0 + 7.5, resend_gap=7.5, give_up_from=5.0 + TICK),
            id="a-stall-over-the-resend-sends-at-the-wake-and-counts-from-it",
        ),
        # A stall that ends before, at or after the deadline.
        pytest.param(
            LATE,
            20.0,
            29.5,
            READ_ONLY,
            replace(LATE, give_up_from=29.5 + TICK),
            id="stall-ends-over-a-tick-before-the-deadline-which-stays",
        ),
        pytest.param(
            LATE,
            20.0,
            30.0 - TICK,
            READ_ONLY,
            replace(LATE, give_up_from=30.0),
            id="stall-ends-a-tick-before-the-deadline-which-stays",
        ),
        pytest.param(
            LATE,
            20.0,
            29.999,
            READ_ONLY,
            _moved(29.999 + TICK),
            id="stall-ends-just-before-the-deadline-which-moves-a-tick-on",
        ),
        pytest.param(
            LATE, 20.0, 30.0, READ_ONLY, OVERTIME, id="stall-ends-at-the-deadline-which-moves"
        ),
        pytest.param(
            LATE, 20.0, 45.0, READ_ONLY, _moved(45.0 + TICK), id="stall-ends-past-it-which-moves"
        ),
        pytest.param(
            replace(LATE, next_resend=20.0),
            29.0,
            30.1,
            READ_ONLY,
            replace(_moved(30.1 + TICK), next_resend=20.0),
            id="the-move-sends-nothing-with-a-resend-overdue",
        ),
        # Overtime is used once.
        pytest.param(
            OVERTIME,
            30.0 + TICK,
            31.0,
            _wake(False, end=True),
            replace(OVERTIME, give_up_from=31.0 + TICK),
            id="a-second-stall-past-the-moved-deadline-ends-giving-nobody-up",
        ),
        pytest.param(
            OVERTIME,
            30.0 + TICK,
            30.0 + TICK,
            _wake(True, end=True),
            OVERTIME,
            id="overtime-ends-on-time-giving-up-the-gone",
        ),
        # The deadline, without a stall.
        pytest.param(LATE, 30.0, 30.0, _wake(True, end=True), LATE, id="deadline-on-time"),
        pytest.param(
            LATE, 30.0, 30.0 + STALL / 2, _wake(True, end=True), LATE, id="deadline-a-hair-late"
        ),
        pytest.param(
            LATE,
            30.0,
            30.0 + TICK,
            READ_ONLY,
            _moved(30.0 + 2 * TICK),
            id="deadline-a-tick-late-a-stall-which-moves-it",
        ),
    ],
)
def test_what_a_phase_does_on_waking(
    times: PhaseDeadline, planned: float, at: float, wake: Wake, after: PhaseDeadline
) -> None:
    assert times.woke(planned, at) == (after, wake)


READ_AFTER_S = 0.001
"""How long after a stall what it kept unread is read: the phase's own
timer, overdue, wakes it first (as the real one does)."""


@dataclass(frozen=True)
class Member:
    acks_at: float = math.inf
    """When its ack is sent."""
    dies_at: float = math.inf
    """When it stops beating."""
    beat_s: float = 0.2


@dataclass(frozen=True)
class Timeline:
    """Stalls of the coordinator's process, each ``[start, end)``."""

    stalls: tuple[tuple[float, float], ...] = ()

    def runs(self, t: float) -> float:
        """When the process runs what was due at ``t``."""
        return next((end for start, end in self.stalls if start <= t < end), t)

    def read_at(self, t: float) -> float:
        """When a message sent at ``t`` is read: at once, but for one sent in
        a stall, or as it ends (the phase's timer, overdue, goes first)."""
        ends = next((end for start, end in self.stalls if start <= t <= end), None)
        return t if ends is None else ends + READ_AFTER_S

    def gone(self, member: Member, at: float) -> bool:
        """Whether the membership calls ``member`` gone at ``at``: three of
        its beats since the last one it read (as ``membership.py`` does)."""
        beat = math.floor(min(at, member.dies_at) / member.beat_s)
        while self.read_at(beat * member.beat_s) > at:
            beat -= 1
        return at >= self.read_at(beat * member.beat_s) + MISSED_BEATS * member.beat_s


@dataclass
class Played:
    acked: set[str] = field(default_factory=set)
    missing: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    resent_at: list[float] = field(default_factory=list)
    wakes: int = 0
    ended_at: float = 0.0


def play(members: dict[str, Member], timeline: Timeline, budget_s: float = BUDGET_S) -> Played:
    """One phase from 0 on ``timeline``, driving the rule as ``phases.py``
    does: wait for the acks until the next wake, then give up, end or resend."""
    times = PhaseDeadline.starting(0.0, budget_s)
    played = Played(missing=set(members))
    at = 0.0

    def read_by(t: float) -> None:
        came = {w for w in played.missing if timeline.read_at(members[w].acks_at) <= t}
        played.acked |= came
        played.missing -= came

    while played.missing and played.wakes < 10_000:
        planned = times.next_wake(at)
        if planned is None:
            break
        woke = timeline.runs(planned)
        complete = max(timeline.read_at(members[w].acks_at) for w in played.missing)
        if complete < woke:
            at = played.ended_at = complete
            read_by(at)
            break
        played.wakes += 1
        at = played.ended_at = woke
        read_by(at)
        times, wake = times.woke(planned, at)
        if wake.give_up_gone:
            gone = {w for w in played.missing if timeline.gone(members[w], at)}
            played.lost |= gone
            played.missing -= gone
        if wake.end:
            break
        if wake.resend_all and played.missing:
            played.resent_at.append(at)
    return played


LONG_STALL_S = 1.5
"""Over seven beats of 0.2 s: every member looks gone at the wake."""


@pytest.mark.parametrize(
    ("acks_at", "stall", "acked"),
    [
        pytest.param(28.0, (28.0, 31.0), True, id="acked-as-a-stall-began-that-ended-after"),
        pytest.param(29.0, (29.0, 30.0), True, id="acked-as-a-stall-began-that-ended-at"),
        pytest.param(29.0, (29.0, 30.0 - READ_AFTER_S / 2), True, id="...that-ended-just-before"),
        pytest.param(29.0, (29.0, 29.9), True, id="...that-ended-within-a-tick-of-it"),
        pytest.param(29.0, (29.0, 29.6), True, id="...that-ended-over-a-tick-before"),
        pytest.param(29.0, (30.1, 31.0), True, id="acked-in-time-before-a-stall"),
        pytest.param(30.1, (29.0, 31.0), True, id="acked-late-in-the-stall-read-in-its-tick"),
        pytest.param(31.5, (29.0, 31.0), False, id="acked-after-the-moved-deadline"),
    ],
)
def test_an_ack_a_stall_kept_unread_is_read_before_the_phase_ends(
    acks_at: float, stall: tuple[float, float], acked: bool
) -> None:
    """The ack waits unread in the connection until a moment after the
    stall, when the phase's own overdue timer has woken it already."""
    played = play({"w0": Member(acks_at=acks_at)}, Timeline((stall,)))

    assert played.acked == ({"w0"} if acked else set()), played
    assert played.lost == set(), "a stall is no member's silence"
    assert played.ended_at <= stall[1] + TICK, "the deadline moves a tick past the wake at most"


def test_a_stall_that_ends_just_before_the_deadline_reads_the_acks_before_ending() -> None:
    """The deadline comes before what the stall kept unread can be read: it
    moves a tick past the wake (without that, 4 of 6 real runs failed)."""
    ends = 30.0 - READ_AFTER_S / 2
    played = play({"w0": Member(acks_at=29.0)}, Timeline(((29.0, ends),)))

    assert played.acked == {"w0"}
    assert played.ended_at == ends + READ_AFTER_S > BUDGET_S


def test_the_deadline_moves_only_once() -> None:
    """A second stall past the moved deadline ends the phase there: the
    member whose ack it held up is missing, not given up."""
    first, second = (29.0, 30.05), (30.1, 30.9)
    played = play({"w0": Member(acks_at=30.2)}, Timeline((first, second)))

    assert (played.missing, played.lost) == ({"w0"}, set())
    assert played.ended_at == second[1]


def test_a_stall_mid_phase_gives_up_no_member_but_one_gone_is_given_up_after() -> None:
    """Every member looks silent at the wake after a stall; a tick later
    their beats are read, and only the one that really stopped is gone."""
    members = {"w0": Member(acks_at=10.0), "w1": Member(acks_at=10.0), "w2": Member(dies_at=4.0)}
    played = play(members, Timeline(((5.0, 5.0 + LONG_STALL_S),)))

    assert (played.acked, played.lost, played.missing) == ({"w0", "w1"}, {"w2"}, set())


def test_a_stall_no_longer_than_a_tick_gives_up_no_member_either() -> None:
    """A wake at 29.0 plans the next at 29.25; a stall from just after it to
    29.5 makes that wake a tick late. Its member, beating every 0.15 s,
    looks silent since 28.95: over three beats, though the silence was this
    process's. Taken for a stall (late by more than ``STALL_S``), it is
    read first, and the member acks in time."""
    played = play({"w0": Member(acks_at=29.3, beat_s=0.15)}, Timeline(((29.001, 29.5),)))

    assert (played.acked, played.lost) == ({"w0"}, set())


def test_a_member_that_stops_beating_is_given_up_at_once_not_at_the_deadline() -> None:
    played = play({"w0": Member(dies_at=2.0), "w1": Member(acks_at=1.0)}, Timeline())

    assert (played.acked, played.lost) == ({"w1"}, {"w0"})
    assert played.ended_at <= 2.0 + MISSED_BEATS * 0.2 + TICK


def test_wakes_a_tick_apart_whatever_the_stalls() -> None:
    """An overdue re-send after a stall is sent at the wake and the next
    counted from it: the phase never plans a wake in the past and spins."""
    played = play({"w0": Member()}, Timeline(((3.5, 5.0), (12.0, 14.0))))

    assert played.wakes <= BUDGET_S / TICK + 2
    assert played.resent_at == [5.0, 14.0, 14.0 + 15.0], "each gap from the wake that sent"
    assert played.missing == {"w0"}


@pytest.mark.parametrize(
    ("budget_s", "resent_at"),
    [
        pytest.param(30.0, [3.75, 3.75 + 7.5, 11.25 + 15.0], id="an-eighth-then-doubling"),
        pytest.param(2.0, [1.0], id="at-least-a-second"),
        pytest.param(0.5, [], id="none-in-a-short-phase"),
    ],
)
def test_the_resends_to_a_member_that_never_acks(budget_s: float, resent_at: list[float]) -> None:
    played = play({"w0": Member()}, Timeline(), budget_s)

    assert played.resent_at == resent_at
    assert (played.missing, played.ended_at) == ({"w0"}, budget_s)


class StallingClock:
    """The event loop's clock, which a test moves on while nothing runs: a
    stall of the whole process (a long garbage collection, a starved CPU)
    as everything in it sees one, with no real sleep. Every timer due in
    the stall fires late, and what was sent meanwhile is read after that."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._time = loop.time
        self._stalled_s = 0.0

    def __enter__(self) -> StallingClock:
        self._loop.time = self.time  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc_info: object) -> None:
        del self._loop.time

    def time(self) -> float:
        return self._time() + self._stalled_s

    def stall(self, seconds: float) -> None:
        self._stalled_s += seconds


def _hold(loading: asyncio.Event, loaded: asyncio.Event) -> Callable[[], Awaitable[None]]:
    """A load that starts (its engine paused) and ends when ``loaded`` is set."""

    async def load() -> None:
        loading.set()
        await loaded.wait()

    return load


@pytest.mark.looptime
async def test_in_memory_a_stall_mid_phase_gives_up_no_member() -> None:
    """The real coordinator and agents, the engines paused and loading:
    every member looks silent for over seven beats when the pause's and the
    load's phases wake after the stall, and the beats that came meanwhile
    are read before anyone is given up."""
    with StallingClock(asyncio.get_running_loop()) as clock:
        async with InMemoryFleet({"w0": 1, "w1": 2}) as fleet:
            loading = {worker_id: asyncio.Event() for worker_id in fleet.engines}
            loaded = asyncio.Event()
            for worker_id, engine in fleet.engines.items():
                engine.on_load = _hold(loading[worker_id], loaded)
            asking = asyncio.create_task(
                fleet.client().update("policy", "/adapters/p/1", version=1)
            )
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in loading.values())), 30)
            clock.stall(STALL_S)
            await asyncio.sleep(2.0)
            loaded.set()
            result = await asyncio.wait_for(asking, 60)

    assert result.committed, result.error


PHASE_S = 1.0
"""The pause's budget; the load it carries has twice that from the pause's start."""


@pytest.mark.looptime
@pytest.mark.parametrize(
    "past_deadline_s",
    [
        pytest.param(PHASE_S + 0.5, id="ends-past-every-deadline"),
        pytest.param(-READ_AFTER_S / 2, id="ends-just-before-the-pauses-deadline"),
    ],
)
async def test_in_memory_an_ack_sent_as_a_stall_began_is_read_before_the_phase_ends(
    past_deadline_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load's ack (carrying the pause's) is handed to the connection as
    a stall begins, and read a moment after it ends: after every deadline
    of the update, or after the pause's, which the stall ended just before.
    The phase, woken first by its own overdue timer, reads it before it
    calls the member missing."""
    deadlines: dict[float, PhaseDeadline] = {}  # each phase's times as it started, by budget
    starting = PhaseDeadline.starting

    def spied(started: float, timeout_s: float) -> PhaseDeadline:
        times = deadlines[timeout_s] = starting(started, timeout_s)
        return times

    send_ack = AgentBus.publish_ack
    stalled: list[Ack] = []

    async def stall_then_send(bus: AgentBus, ack: Ack) -> None:
        if ack.phase == "load" and not stalled:
            stalled.append(ack)
            pause_deadline = deadlines[PHASE_S].deadline
            clock.stall(pause_deadline + past_deadline_s - clock.time())
            await asyncio.sleep(READ_AFTER_S)
        await send_ack(bus, ack)

    monkeypatch.setattr(PhaseDeadline, "starting", staticmethod(spied))
    monkeypatch.setattr(AgentBus, "publish_ack", stall_then_send)
    with StallingClock(asyncio.get_running_loop()) as clock:
        async with InMemoryFleet({"w0": 2}, phase_timeout_s=PHASE_S, leader_lease_s=30.0) as fleet:
            fleet.engines["w0"].on_load = lambda: asyncio.sleep(0.3)
            result = await asyncio.wait_for(
                fleet.client().update("policy", "/adapters/p/1", version=1), 60
            )

    assert [ack.ok for ack in stalled] == [True]
    assert result.committed, result.error
