"""When a phase wakes, gives members up, sends again or ends: its deadline rule.

A phase (``phases.py``) sends a command and waits for its members' acks
until all have come or its deadline has. What it does meanwhile depends on
the clock alone, so it is written here as a pure function of the clock's
readings: :meth:`PhaseDeadline.next_wake` says when to wake, and
:meth:`PhaseDeadline.woke` what to do on waking and what holds from then on.
``phases.py`` does the waiting, the looks at the membership and the sends;
``tests/test_phase_deadline.py`` runs every case on a made-up clock.

The rule:

- A phase wakes at its deadline, at its next re-send or a tick
  (:data:`LIVENESS_TICK_S`) after it last woke, whichever comes first, and
  never before now: a wake whose time has passed counts from now.
- On waking it gives up the members that stopped beating (no use waiting
  for them until the deadline); then, if its deadline has come, it ends,
  and who has not acked is missing. Otherwise it sends the command again:
  to every member still waiting once the re-send time has come (an eighth
  of the budget after the start, at least 1 s, then each gap twice the one
  before, from the wake that sent), else only to members that the look
  found (re)joined after theirs was sent.
- A wake more than :data:`STALL_S` later than planned means this process
  stalled (a long garbage collection, a starved CPU): what members sent
  meanwhile is unread in its connection yet, and their silence was its own.
  The bar is low (a timer fires within milliseconds when nothing holds the
  process): a stall taken for none would give members up for silence that
  was this process's, while a hiccup taken for a stall costs at most a
  tick before the gone are given up. For a tick
  from that wake it gives no member up. If its deadline would come within
  that tick (it passed during the stall, or comes just after it), the
  deadline moves to the tick's end, and that wake does nothing else: the
  acks read in the tick count. It moves once per phase: a stall past the
  moved deadline ends the phase, giving no member up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

LIVENESS_TICK_S = 0.25
"""The longest a phase waits between looks at the membership; after a stall,
as long is given to read what the stall kept unread."""
STALL_S = 0.05
"""A wake later than planned by more than this is a stall. Not a tick: a
phase may have waited up to a tick already, so a stall of up to two would
go unseen, long enough to take three beats of 0.2 s for a member's death."""
_FIRST_RESEND_S = 1.0
"""A re-send only helps a member whose command was lost, and each costs a
signed publish per member still busy: engines answer a load in seconds, not
in this. So the first one waits an eighth of the phase's deadline, at least
this long (3.75 s of a 30 s phase), and the gap doubles after each. A member
that (re)joined after its command was sent (an agent starting, one cut off
from the bus for a beat) likely missed it: it gets it again at once."""
_FIRST_RESEND_SHARE = 1 / 8


def first_resend_gap(timeout_s: float) -> float:
    """How long after its start a phase of ``timeout_s`` first sends again."""
    return max(_FIRST_RESEND_S, timeout_s * _FIRST_RESEND_SHARE)


@dataclass(frozen=True, kw_only=True)
class Wake:
    """What a phase does on one wake, in this order."""

    give_up_gone: bool
    """Give up the members that stopped beating (not within a tick of a stall)."""
    end: bool
    """Then end the phase: its deadline has come."""
    resend_all: bool
    """Else send the command again to every member still waiting (if not,
    only to those that (re)joined after theirs was sent)."""


_READ_ONLY = Wake(give_up_gone=False, end=False, resend_all=False)
"""The overtime after a stall: read what it kept unread, and nothing else."""


@dataclass(frozen=True, kw_only=True)
class PhaseDeadline:
    """A phase's times (on the event loop's clock), between two wakes."""

    deadline: float
    next_resend: float
    resend_gap: float
    """The wait before the next re-send, counted from the last (or the start)."""
    give_up_from: float
    """No member is given up before this (a tick after a stall)."""
    overtime: bool = False
    """The deadline has moved once, past a stall."""

    @classmethod
    def starting(cls, started: float, timeout_s: float) -> PhaseDeadline:
        gap = first_resend_gap(timeout_s)
        return cls(
            deadline=started + timeout_s,
            next_resend=started + gap,
            resend_gap=gap,
            give_up_from=started,
        )

    def next_wake(self, at: float) -> float | None:
        """When to wake next, if the clock reads ``at`` now; None once the
        deadline has come (the phase ends)."""
        if at >= self.deadline:
            return None
        return max(at, min(self.deadline, self.next_resend, at + LIVENESS_TICK_S))

    def woke(self, planned: float, at: float) -> tuple[PhaseDeadline, Wake]:
        """What to do on waking at ``at`` from a wait planned to end at
        ``planned``, with some member still waiting; and the times from then on."""
        state = self
        if at - planned > STALL_S:  # a stall: what came meanwhile is unread
            read_by = at + LIVENESS_TICK_S
            if state.deadline < read_by and not state.overtime:
                moved = replace(state, deadline=read_by, give_up_from=read_by, overtime=True)
                return moved, _READ_ONLY
            state = replace(state, give_up_from=read_by)
        give_up_gone = at >= state.give_up_from
        if at >= state.deadline:
            return state, Wake(give_up_gone=give_up_gone, end=True, resend_all=False)
        if at < state.next_resend:
            return state, Wake(give_up_gone=give_up_gone, end=False, resend_all=False)
        gap = 2 * state.resend_gap
        later = replace(state, next_resend=at + gap, resend_gap=gap)
        return later, Wake(give_up_gone=give_up_gone, end=False, resend_all=True)
