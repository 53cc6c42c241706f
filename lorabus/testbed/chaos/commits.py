"""What the fleet committed, adapter by adapter, as a chaos run saw it.

The checks of what engines serve (``serving``, ``restarts``) ask the
timeline the same questions: which updates committed, of which adapter,
which members each counted, what each commit keeps beside it, and from
when on the run knows for sure that a commit point was written, or that
an agent may have read one.

- A commit is **known** from the first of: its committed answer, or its
  ``committed`` notice seen on the bus. Both come after its commit point
  was written (coordinator/commit.py: write, answer, announce), so a reader
  that starts after that finds it.
- What a commit **keeps** beside it (the served names of the adapter's
  earlier versions every engine serves too) is what its notice says; a
  commit whose notice was not seen keeps nothing known.
- A commit **may have been read** from the moment its request was first
  sent: its commit point cannot be older, and an agent reading the fleet's
  records may find it before anyone is answered.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass

from lorabus.schemas import UpdateResult
from lorabus.testbed.chaos.timeline import Timeline, UpdateRecord


def ok_members(result: UpdateResult) -> list[str]:
    """The members a result counts as ok (from its rank map when they were
    left out so that the result fits one message)."""
    if "serving_workers" in result.trimmed:
        entries = result.rank_map.entries if result.rank_map is not None else []
        return sorted(entry.worker_id for entry in entries)
    return sorted(w for w, outcome in result.workers.items() if outcome.ok)


def committed_updates(timeline: Timeline) -> list[UpdateRecord]:
    """The updates answered committed, in the order their answers came."""
    done = [
        u
        for u in timeline.updates
        if u.result is not None and u.result.committed and u.answered_at is not None
    ]
    return sorted(done, key=lambda u: u.answered_at or 0.0)


def last_committed(timeline: Timeline) -> dict[str, UpdateRecord]:
    """Adapter -> its newest committed update (by version; versions rise)."""
    newest: dict[str, UpdateRecord] = {}
    for update in committed_updates(timeline):
        known = newest.get(update.adapter)
        if known is None or update.version >= known.version:
            newest[update.adapter] = update
    return newest


@dataclass(frozen=True)
class Commit:
    """One commit of one adapter, or an update that may have committed."""

    update_id: str
    adapter: str
    version: int
    served_name: str
    sent_at: float
    """From when its commit point may have been read (its request's first send)."""
    known_at: float
    """From when it was surely written (inf: not known to have committed)."""
    kept: frozenset[str] | None
    """The served names kept beside it (None: unknown)."""

    @property
    def known(self) -> bool:
        return self.known_at < math.inf

    def serves(self) -> frozenset[str]:
        """What every engine must serve of its adapter once an agent knows this
        commit, as far as the run can tell (nothing, for an update that may
        or may not have committed: it may keep anything or nothing)."""
        if not self.known:
            return frozenset()
        return frozenset({self.served_name}) | (self.kept or frozenset())


def commit_history(timeline: Timeline) -> dict[str, list[Commit]]:
    """Per adapter, its commits by version, and the updates sent that got no
    terminal result (they may have committed)."""
    history: dict[str, list[Commit]] = {}
    for update in timeline.updates:
        result, sent = update.result, update.sent_at
        if sent is None:
            continue  # never asked for
        if result is not None and not result.committed:
            continue  # a failure commits nothing
        notice = timeline.notices.get((update.adapter, update.version))
        known = math.inf
        if result is not None and update.answered_at is not None:
            known = update.answered_at
        if notice is not None:
            known = min(known, notice.at)
        history.setdefault(update.adapter, []).append(
            Commit(
                update_id=update.update_id,
                adapter=update.adapter,
                version=update.version,
                served_name=result.adapter if result is not None else "",
                sent_at=sent,
                known_at=known,
                kept=None if notice is None else notice.kept,
            )
        )
    for commits in history.values():
        commits.sort(key=lambda c: (c.version, c.known_at))
    return history


@dataclass(frozen=True)
class Requirement:
    """What an agent process that started at some moment must have its engine
    serve of one adapter, as time goes on (:func:`requirement`)."""

    base: Commit | None
    """The newest commit known before the process started."""
    sent: list[float]
    """When each newer update was first sent, in that order."""
    serves: list[frozenset[str]]
    """``serves[k]``: what is still required once the first ``k`` newer
    updates may have been read."""

    def names(self, until: float) -> frozenset[str]:
        """What is required of a heartbeat seen at ``until``."""
        return self.serves[bisect_left(self.sent, until)]


def requirement(commits: list[Commit], since: float) -> Requirement:
    """What an agent process that started at ``since`` must have its engine
    serve of one adapter (``commits``, its :func:`commit_history`): the newest
    commit known before it started (its first read of the fleet's records
    shows it, or a newer one) with the versions kept beside it, less what any
    newer update that may have been read since would no longer keep."""
    base = None
    for commit in commits:
        if commit.known_at < since and (base is None or commit.version > base.version):
            base = commit
    if base is None:
        return Requirement(base=None, sent=[], serves=[frozenset()])
    newer = sorted((c for c in commits if c.version > base.version), key=lambda c: c.sent_at)
    serves = [base.serves()]
    for commit in newer:
        serves.append(serves[-1] & commit.serves())
    return Requirement(base=base, sent=[c.sent_at for c in newer], serves=serves)
