"""The invariants on the fleet's processes: ``fencing`` and ``crash``.

``fencing``: every ``command_refused`` for its epoch refused an older epoch
than the one the agent had seen, and no command an agent acted on (its ack)
was already stale when it was sent (its epoch below what that agent process
had reported seeing before the command was seen on the bus). A handled
command is judged by the commands it can have been (same update, type,
worker and epoch; any epoch when the event carries none, as older agents
send). A violation names the adapter of the update the command was for.

``crash``: no agent or coordinator process exits unless a fault killed it.
"""

from __future__ import annotations

from lorabus.testbed.chaos.timeline import Timeline
from lorabus.testbed.chaos.verdict import Violation

_FENCED = "it has seen epoch"
"""How an agent words a refusal of an older epoch (agents/fencing.py); its
other refusals are of commands it cannot prove yet, such as one of an epoch
ahead of the leader record it read before a partition healed, which the
leader sends again."""


def check_fencing(timeline: Timeline) -> list[Violation]:
    adapters = timeline.adapters_of_updates()
    violations = []
    for at, refused in timeline.refused:
        if not refused.reason.startswith(_FENCED):
            continue  # unproven (ahead of the leader record it has read): re-sent, not fenced
        if refused.epoch >= refused.epoch_seen:
            violations.append(
                Violation(
                    invariant="fencing",
                    subject=refused.worker_id,
                    adapter=adapters.get(refused.update_id, ""),
                    detail=f"refused {refused.command} of update {refused.update_id} with "
                    f"epoch {refused.epoch} at {timeline.at(at)} although it had only seen "
                    f"epoch {refused.epoch_seen}",
                )
            )
    for at, handled in timeline.handled:
        worker_id = handled.worker_id
        since = timeline.process_start(worker_id, at)
        candidates = [
            c
            for c in timeline.commands.get((handled.update_id, str(handled.phase), worker_id), [])
            if since <= c.at <= at
        ]
        if handled.epoch > 0:
            candidates = [c for c in candidates if c.epoch == handled.epoch]
        if not candidates:
            continue  # not seen on the bus here (e.g. sent while NATS restarted)
        stale = [(c, timeline.epoch_floor(worker_id, c.at)) for c in candidates]
        if all(c.epoch < floor for c, floor in stale):
            first, floor = stale[0]
            violations.append(
                Violation(
                    invariant="fencing",
                    subject=worker_id,
                    adapter=adapters.get(handled.update_id, ""),
                    detail=f"acted on {handled.phase} of update {handled.update_id} (handled "
                    f"at {timeline.at(at)}, ok={handled.ok}); every such command was stale when "
                    f"sent, e.g. epoch {first.epoch} at {timeline.at(first.at)} after the agent "
                    f"had reported epoch {floor}",
                )
            )
    return violations


def check_crashes(timeline: Timeline) -> list[Violation]:
    return [
        Violation(invariant="crash", subject=crash.split(" ", 1)[0], detail=crash)
        for crash in timeline.crashes
    ]
