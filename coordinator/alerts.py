"""Members that need a person's look, as the leader sees them: an engine paused
while no update is in flight, and an engine that is not ready.

Both are normal for a moment (a resume ack still on its way, an agent loading
the committed adapter after a restart), so a condition is raised only once it
has held for a while, and cleared once it no longer holds. The leader emits a
``member_alert`` event at each change and the metrics count the raised ones.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import msgspec

from lorabus.coordinator.membership import Member


class Condition(enum.StrEnum):
    PAUSED_OUTSIDE_UPDATE = "paused_outside_update"
    """Nobody resumes it but its agent's pause lease; until then it serves nothing."""
    NOT_READY = "not_ready"
    """Its agent has not brought the engine to the committed state."""


PAUSED_ALERT_AFTER_S = 3.0
"""A paused engine with no update in flight is raised after this long: a resume
or its ack may still be on the way when an update ends."""
NOT_READY_ALERT_AFTER_S = 30.0
"""An engine not ready is raised after this long (a reload after an agent's
restart takes a few seconds), or at once when its agent says why it cannot
converge."""


class Change(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    condition: Condition
    reason: str
    cleared: bool


class MemberAlerts:
    def __init__(self) -> None:
        self.active: dict[tuple[str, Condition], str] = {}
        """The raised alerts, ``(worker_id, condition) -> reason``."""
        self._since: dict[tuple[str, Condition], float] = {}

    def evaluate(
        self, live: Mapping[str, Member], *, update_running: bool, at: float
    ) -> list[Change]:
        """Raise what has held long enough, clear what no longer holds (a member
        that is gone included); return the changes, raised and cleared."""
        holding: dict[tuple[str, Condition], tuple[str, float]] = {}
        for worker_id, member in live.items():
            beat = member.heartbeat
            if beat.paused and not update_running:
                holding[(worker_id, Condition.PAUSED_OUTSIDE_UPDATE)] = (
                    "paused while no update is in flight",
                    PAUSED_ALERT_AFTER_S,
                )
            if not beat.ready:
                holding[(worker_id, Condition.NOT_READY)] = (
                    beat.unready_reason or "not at the committed state",
                    0.0 if beat.unready_reason else NOT_READY_ALERT_AFTER_S,
                )
        changes = []
        for key, reason in list(self.active.items()):
            if key not in holding:
                del self.active[key]
                changes.append(
                    Change(worker_id=key[0], condition=key[1], reason=reason, cleared=True)
                )
        self._since = {key: self._since.get(key, at) for key in holding}
        for key, (reason, after_s) in holding.items():
            if key not in self.active and at - self._since[key] >= after_s:
                self.active[key] = reason
                changes.append(
                    Change(worker_id=key[0], condition=key[1], reason=reason, cleared=False)
                )
        return changes

    def counts(self) -> dict[Condition, int]:
        """How many members each condition has raised."""
        counts = dict.fromkeys(Condition, 0)
        for _, condition in self.active:
            counts[condition] += 1
        return counts

    def forget(self) -> None:
        """Out of the lead: what this coordinator saw is no longer the fleet's word."""
        self.active.clear()
        self._since.clear()
