"""What a failed update undoes: its version, unloaded wherever it may have loaded.

So that no request for a version that did not commit is routed to a subset
of the fleet, it is unloaded where a load ack lists it, and where a load went
unanswered or a pause that carried one was (unloading a name an engine lacks
succeeds). Each agent runs it behind any load of its own, and it is
gathered and re-sent like any phase. Reported, never fatal to the update.

A fixed name that failed to load still serves the committed weights where it
serves at all, so it is left be; unless the new weights did load and the
canary rejected them: then it is unloaded too, and each agent loads the
committed version again (convergence).
"""

from __future__ import annotations

import logging
from collections.abc import Set

from lorabus.coordinator.phases import Commands, PhaseOutcome
from lorabus.coordinator.plan import UpdatePlan
from lorabus.schemas import UnloadCommand

log = logging.getLogger(__name__)


async def withdraw(
    commands: Commands,
    plan: UpdatePlan,
    load: PhaseOutcome | None,
    *,
    may_have_loaded: Set[str],
    rejected: bool,
) -> PhaseOutcome | None:
    """Unload ``plan``'s version after ``load`` (``may_have_loaded``: members
    left out whose pause, carrying the load, may still have landed;
    ``rejected``: the canary failed); the unload phase, if one ran."""
    if load is None or (plan.replace and not rejected):
        return None
    holders = {w for w, a in load.acks.items() if plan.served_name in a.adapters}
    targets = sorted(holders | set(load.missing) | set(load.lost) | set(may_have_loaded))
    if not targets:
        return None
    names = [plan.served_name]
    unload = commands.named(UnloadCommand, plan.update_id, targets, names=names)
    outcome = await commands.phase(unload, targets)
    if not outcome.ok:
        log.warning("update=%s unloading %s: %s", plan.update_id, names, outcome.summary().message)
    return outcome
