"""The quorum policy: how much of the fleet an update may go on without.

With ``--quorum`` 1 (the default) every member of the snapshot must pass
every phase; below 1, an update goes on without members that fail a phase
as long as the others' world sizes sum to at least that share of the
expected world size. Those left out are named in the result, left out of
the rank map, and fenced until they catch up.
"""

from __future__ import annotations

import logging
import math

from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.phases import PhaseOutcome
from lorabus.schemas import ErrorInfo

log = logging.getLogger(__name__)


class QuorumPolicy:
    def __init__(self, config: CoordinatorConfig, *, world_size: int | None = None) -> None:
        """``world_size``: the whole it counts (the workers an update is
        placed on; None: the fleet's expected world size)."""
        self.quorum = config.quorum
        whole = config.expected_world_size if world_size is None else world_size
        self.needed_world_size = math.ceil(config.quorum * whole - 1e-9)
        """The world size an update must keep to go on."""

    def going_on(
        self, outcome: PhaseOutcome, targets: list[str], members: dict[str, int]
    ) -> list[str] | None:
        """The targets to go on with (those the phase did not fail), or None
        when too few are left: the phase failed the update."""
        if outcome.ok:
            return targets
        errors = outcome.worker_errors()
        survivors = [wid for wid in targets if wid not in errors]
        if sum(members[wid] for wid in survivors) < self.needed_world_size:
            return None
        log.warning(
            "going on without %s after %s (quorum %s)", sorted(errors), outcome.phase, self.quorum
        )
        return survivors

    def resumed(
        self, unresumed: dict[str, ErrorInfo], serving: list[str], members: dict[str, int]
    ) -> list[str] | None:
        """The serving members that confirmed their resume, or None when too few
        did. A member left out earlier that cannot be reached (its agent died)
        is named in the result but does not undo the commit of the others; its
        engine resumes when its pause lease runs out or its agent restarts."""
        still = [wid for wid in serving if wid not in unresumed]
        if len(still) == len(serving):
            return serving
        if sum(members[wid] for wid in still) < self.needed_world_size:
            return None
        log.warning("committing without %s: their resume was not confirmed", sorted(unresumed))
        return still
