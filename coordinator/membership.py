"""Fleet membership, learnt from heartbeats.

An agent is live while its last heartbeat is younger than three of its own
beat intervals; one silent for ``FORGET_AFTER_BEATS`` of them is forgotten,
so workers that come and go do not grow the table for the coordinator's
lifetime. ``wait_quorum`` blocks until live agents' world sizes sum to the
expected world size and returns that membership as a snapshot.

One worker id, one agent: each agent process beats with a random instance id.
A heartbeat from another instance while the holder beats does not replace
it; the newcomer is held as a contender. If the holder beats again after
that (so it is not a restart of a dead holder), the contender is refused:
:meth:`Membership.observe` returns the :class:`Conflict`, which the bus
reports and, when leading, tells the newcomer so it exits. A refusal can be
lost, held by the newcomer's fencing and replaced, or not sent at all by a
coordinator not yet leading: while the newcomer keeps beating, the conflict
comes back every ``REFUSE_AGAIN_AFTER_BEATS`` of its beats (marked ``again``,
so it is sent, not reported, once more). A holder that
missed a beat is taken for dead once another instance beats (a restarted
agent takes its place at once, not three beats later), and a phase that
finds a holder gone gives its place to a contender still beating and sends
that one the command, instead of giving the worker up.

The metrics collector reads the table from its HTTP thread: every read
starts from a copy of the table (one C-level call, so it cannot see the
event loop's thread change it halfway).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple, TypeVar

import msgspec

from lorabus.errors import QuorumNotReached
from lorabus.runtime.cancellation import raise_if_cancelled
from lorabus.runtime.clock import now
from lorabus.schemas import Ack, Heartbeat

_T = TypeVar("_T")

MISSED_BEATS = 3
FORGET_AFTER_BEATS = 100
REFUSE_AGAIN_AFTER_BEATS = 3
CONFLICT_SHOWN_S = 300.0
"""How long the status keeps showing a refused second agent after it fell silent."""
_FORGET_CHECK_S = 1.0
_REJOIN_AFTER_BEATS = 2.5
"""Silent this long, in beat periods: it may have been cut off from the bus. Two
periods pass between beats when an agent skips one that an ack made redundant
(agents/beats.py); more means a beat went missing."""


class Member(msgspec.Struct, kw_only=True):
    heartbeat: Heartbeat
    seen_at: float
    joined_at: float
    """When this instance was first heard, or heard again after a missed beat:
    a command sent before then may never have reached it."""


class Contender(msgspec.Struct, kw_only=True):
    """A second instance beating with a live member's worker id."""

    heartbeat: Heartbeat
    first_seen: float
    last_seen: float
    refused_at: float | None = None

    @property
    def refused(self) -> bool:
        return self.refused_at is not None


class Conflict(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    holder: Heartbeat
    refused: Heartbeat
    again: bool = False
    """Refused before, and still beating: to be sent the refusal again."""


class Triage(NamedTuple):
    gone: list[str]
    """Not live."""
    rejoined: list[str]
    """Live, and (re)joined after the command was sent to them."""
    quiet_until: float
    """Until then none of those live can turn gone, and none can rejoin unless
    :attr:`Membership.generation` moves: a phase need not look again before."""


class Membership:
    def __init__(self, clock: Callable[[], float] = now) -> None:
        self._clock = clock
        self._started_at = clock()
        self._members: dict[str, Member] = {}
        self._contenders: dict[str, Contender] = {}
        self._changed = asyncio.Event()
        self._forget_checked_at = 0.0
        self.generation = 0
        """Moves whenever a member joins, rejoins, is forgotten or changes its
        beat interval: the only changes that can end a :class:`Triage`'s quiet
        before its ``quiet_until``."""

    def observe(self, heartbeat: Heartbeat) -> Conflict | None:
        """Take ``heartbeat`` in; return the conflict it settles, if any (a
        contender to refuse: reported once per contending instance, then
        ``again`` while it keeps beating)."""
        at = self._clock()
        worker_id = heartbeat.worker_id
        known = self._members.get(worker_id)
        if (
            known is not None
            and known.heartbeat.instance != heartbeat.instance
            and _alive(known, at)
            and not _missed_a_beat(known, at)
        ):
            return self._contend(known, heartbeat, at)
        if known is None or (
            known.heartbeat.world_size,
            known.heartbeat.ready,
            known.heartbeat.unready_reason,
        ) != (heartbeat.world_size, heartbeat.ready, heartbeat.unready_reason):
            self._changed.set()
        rejoined = (
            known is None
            or known.heartbeat.instance != heartbeat.instance
            or at - known.seen_at > _REJOIN_AFTER_BEATS * known.heartbeat.interval_s
        )
        if known is None or rejoined or known.heartbeat.interval_s != heartbeat.interval_s:
            self.generation += 1
        member = self._members[worker_id] = Member(
            heartbeat=heartbeat,
            seen_at=at,
            joined_at=at if rejoined or known is None else known.joined_at,
        )
        if at - self._forget_checked_at >= _FORGET_CHECK_S:
            self._forget_checked_at = at
            self._forget_silent(at)
        contender = self._contenders.get(worker_id)
        if contender is None:
            return None
        if contender.heartbeat.instance == heartbeat.instance:
            del self._contenders[worker_id]  # the holder died and it took the place
            return None
        if not _contending(contender, at):
            return None  # gone: kept for the status until CONFLICT_SHOWN_S
        return self._refuse(member, contender, at)

    def _contend(self, holder: Member, heartbeat: Heartbeat, at: float) -> Conflict | None:
        contender = self._contenders.get(heartbeat.worker_id)
        if contender is None or contender.heartbeat.instance != heartbeat.instance:
            contender = Contender(heartbeat=heartbeat, first_seen=at, last_seen=at)
            self._contenders[heartbeat.worker_id] = contender
            return None
        contender.heartbeat = heartbeat
        contender.last_seen = at
        if holder.seen_at > contender.first_seen:
            return self._refuse(holder, contender, at)
        return None

    @staticmethod
    def _refuse(holder: Member, contender: Contender, at: float) -> Conflict | None:
        refused_at = contender.refused_at
        wait_s = REFUSE_AGAIN_AFTER_BEATS * contender.heartbeat.interval_s
        if refused_at is not None and at - refused_at < wait_s:
            return None
        contender.refused_at = at
        return Conflict(
            worker_id=contender.heartbeat.worker_id,
            holder=holder.heartbeat,
            refused=contender.heartbeat,
            again=refused_at is not None,
        )

    def conflicts(self) -> list[tuple[Contender, float]]:
        """Contenders heard from in the last ``CONFLICT_SHOWN_S``, with how long
        ago; safe from another thread."""
        at = self._clock()
        return [
            (c, at - c.last_seen)
            for c in self._contenders.copy().values()
            if at - c.last_seen < CONFLICT_SHOWN_S
        ]

    def _forget_silent(self, at: float) -> None:
        silent = [
            wid
            for wid, member in self._members.items()
            if at - member.seen_at >= FORGET_AFTER_BEATS * member.heartbeat.interval_s
        ]
        for worker_id in silent:
            del self._members[worker_id]
        if silent:
            self.generation += 1
        for worker_id in [
            w for w, c in self._contenders.items() if at - c.last_seen >= CONFLICT_SHOWN_S
        ]:
            del self._contenders[worker_id]

    def observe_ack(self, ack: Ack) -> None:
        """An ack carries the engine's state as of the command: agents do not
        beat after each command, so the status learns it from here. It is a
        sign of life of a live member too, as agents skip a beat an ack made
        redundant (agents/beats.py); one gone is left to its next heartbeat."""
        known = self._members.get(ack.worker_id)
        if known is None:
            return
        known.heartbeat = msgspec.structs.replace(
            known.heartbeat, paused=ack.paused, adapters=ack.adapters
        )
        at = self._clock()
        if not _alive(known, at):
            return
        if at - known.seen_at > _REJOIN_AFTER_BEATS * known.heartbeat.interval_s:
            known.joined_at = at  # as a heartbeat after a missed beat would
            self.generation += 1
        known.seen_at = at

    def remembers(self, worker_id: str) -> bool:
        """Whether ``worker_id`` is still remembered, live or not."""
        return worker_id in self._members

    def instance_of(self, worker_id: str) -> str | None:
        """The instance that holds ``worker_id``, if it is known."""
        member = self._members.get(worker_id)
        return None if member is None else member.heartbeat.instance

    def triage(self, worker_ids: Iterable[str], sent_at: Mapping[str, float]) -> Triage:
        """Those of ``worker_ids`` not live, and those live that (re)joined after
        ``sent_at[worker]``. One pass and one clock read: a phase may ask this
        for up to every member four times a second (less, by ``quiet_until``)."""
        at = self._clock()
        members = self._members
        gone: list[str] = []
        rejoined: list[str] = []
        quiet_until = math.inf
        for worker_id in worker_ids:
            member = members.get(worker_id)
            if member is None:
                gone.append(worker_id)
                continue
            # A later beat only moves this later: it stays a lower bound.
            expires = _expires_at(member)
            if at >= expires:
                if self._successor_takes_over(worker_id, at):
                    rejoined.append(worker_id)  # to be sent the command again
                else:
                    gone.append(worker_id)
                continue
            quiet_until = min(quiet_until, expires)
            if member.joined_at > sent_at.get(worker_id, 0.0):
                rejoined.append(worker_id)
        return Triage(gone, rejoined, quiet_until)

    def _successor_takes_over(self, worker_id: str, at: float) -> bool:
        """A silent holder's place goes to the instance that beats in its stead
        (a restarted agent) at once, not at that instance's next beat: a phase
        that would give the worker up sends it the command instead."""
        contender = self._contenders.get(worker_id)
        if contender is None or contender.refused or not _contending(contender, at):
            return False
        del self._contenders[worker_id]
        self._members[worker_id] = Member(
            heartbeat=contender.heartbeat, seen_at=contender.last_seen, joined_at=at
        )
        self.generation += 1
        self._changed.set()
        return True

    def still_quiet(self, generation: int, quiet_until: float) -> bool:
        """Whether a :class:`Triage` taken at ``generation`` still holds."""
        return generation == self.generation and self._clock() < quiet_until

    def joined_at(self, worker_id: str) -> float | None:
        """When ``worker_id``'s agent (re)joined (see :attr:`Member.joined_at`)."""
        member = self._members.get(worker_id)
        return None if member is None else member.joined_at

    def silent_for(self, worker_id: str) -> float:
        """Seconds since ``worker_id`` last counted as live (0: it does); one
        never heard of: since this membership began to listen."""
        at = self._clock()
        member = self._members.get(worker_id)
        if member is None:
            return at - self._started_at
        return 0.0 if _alive(member, at) else at - _expires_at(member)

    def is_live(self, worker_id: str) -> bool:
        member = self._members.get(worker_id)
        return member is not None and _alive(member, self._clock())

    def live(self) -> dict[str, Member]:
        """The live members; safe to call from another thread."""
        at = self._clock()
        return {wid: m for wid, m in self._members.copy().items() if _alive(m, at)}

    def listening_for(self) -> float:
        """Seconds since this membership began to hear heartbeats."""
        return self._clock() - self._started_at

    def layouts(self, workers: Iterable[str]) -> dict[str, tuple[str, int]]:
        """The role and data-parallel ranks of each of ``workers`` that is live,
        as its heartbeat says (for the rank map)."""
        live = self.live()
        return {
            w: (live[w].heartbeat.role, live[w].heartbeat.data_parallel)
            for w in workers
            if w in live
        }

    def remembered(self) -> dict[str, Heartbeat]:
        """The last heartbeat of every worker still remembered, live or not."""
        return {wid: m.heartbeat for wid, m in self._members.copy().items()}

    def known(self) -> list[str]:
        """Every worker still remembered, live or not."""
        return sorted(self._members.copy())

    def age_of(self, member: Member) -> float:
        return self._age(member)

    def live_world_sizes(self) -> dict[str, int]:
        """World sizes of live members that are ready (serve the committed state)."""
        return {wid: m.heartbeat.world_size for wid, m in self.live().items() if m.heartbeat.ready}

    def stuck(self) -> dict[str, tuple[int, str]]:
        """Live members that report why they are not ready (the committed
        adapter cannot be loaded, the engine is not set up for updates):
        ``{worker_id: (world_size, reason)}``."""
        return {
            wid: (m.heartbeat.world_size, m.heartbeat.unready_reason)
            for wid, m in self.live().items()
            if not m.heartbeat.ready and m.heartbeat.unready_reason
        }

    async def wait_quorum(
        self,
        expected_world_size: int,
        timeout_s: float,
        *,
        needed: int | None = None,
        grace_s: float = 0.0,
    ) -> dict[str, int]:
        """Return ``{worker_id: world_size}`` of live, ready agents once they sum to
        the expected size, or, after ``grace_s``, to at least ``needed`` of it."""
        started = self._clock()
        deadline = started + timeout_s
        needed = expected_world_size if needed is None else needed
        while True:
            raise_if_cancelled()
            sizes = self.live_world_sizes()
            total = sum(sizes.values())
            if total == expected_world_size:
                return sizes
            stuck = self.stuck()
            if stuck and expected_world_size - sum(s for s, _ in stuck.values()) < needed:
                # Whoever else comes, these keep the quorum out of reach.
                raise QuorumNotReached(_stuck_message(stuck, total, expected_world_size, needed))
            if needed <= total < expected_world_size and self._clock() - started >= grace_s:
                return sizes
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise QuorumNotReached(
                    _quorum_message(sizes, total, expected_world_size, needed, timeout_s)
                )
            self._changed.clear()
            # Wake on a new member or a world-size change, and at least every
            # 100 ms so members that stopped beating drop out of the sum.
            try:
                async with asyncio.timeout(min(remaining, 0.1)):
                    await self._changed.wait()
            except TimeoutError:
                pass

    async def wait_for(
        self, pick: Callable[[dict[str, Heartbeat]], _T | None], timeout_s: float
    ) -> _T | None:
        """``pick``'s first answer that is not None, of the live members'
        heartbeats (ready or not) as they change; None once ``timeout_s`` passed."""
        deadline = self._clock() + timeout_s
        while True:
            raise_if_cancelled()
            picked = pick({w: m.heartbeat for w, m in self.live().items()})
            remaining = deadline - self._clock()
            if picked is not None or remaining <= 0:
                return picked
            self._changed.clear()
            try:  # as wait_quorum: on a change, and every 100 ms for the silent
                async with asyncio.timeout(min(remaining, 0.1)):
                    await self._changed.wait()
            except TimeoutError:
                pass

    def _age(self, member: Member) -> float:
        return self._clock() - member.seen_at


def _expires_at(member: Member) -> float:
    """When ``member`` stops being live unless it beats again."""
    return member.seen_at + MISSED_BEATS * member.heartbeat.interval_s


def _alive(member: Member, at: float) -> bool:
    return at < _expires_at(member)


def _missed_a_beat(member: Member, at: float) -> bool:
    """Silent for longer than an agent ever is between beats while it runs."""
    return at - member.seen_at > _REJOIN_AFTER_BEATS * member.heartbeat.interval_s


def _contending(contender: Contender, at: float) -> bool:
    return at - contender.last_seen < MISSED_BEATS * contender.heartbeat.interval_s


def _stuck_message(
    stuck: dict[str, tuple[int, str]], total: int, expected: int, needed: int
) -> str:
    named = "; ".join(
        f"{wid} (world size {size}): {reason}" for wid, (size, reason) in sorted(stuck.items())
    )
    return (
        f"quorum cannot be reached (ready world size {total} of {expected}, {needed} needed): "
        f"these members report why they are not ready: {named}"
    )


def _quorum_message(
    sizes: dict[str, int], total: int, expected: int, needed: int, timeout_s: float
) -> str:
    listing = ", ".join(f"{wid}={size}" for wid, size in sorted(sizes.items())) or "none"
    relation = "exceeds" if total > expected else "is short of"
    target = (
        f"the expected {expected}"
        if needed == expected
        else (f"the {needed} of {expected} expected that the quorum needs")
    )
    return (
        f"quorum not reached within {timeout_s:.1f}s: live, ready agents' world sizes sum "
        f"to {total}, which {relation} {target} (live: {listing})"
    )
