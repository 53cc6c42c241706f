"""What an update's run and its steps end as: the run's outcome, the pause
window's, and the result (each member's outcome, the phases' times, the
digest the serving members agreed on)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from lorabus.coordinator.digests import agreed_digest
from lorabus.coordinator.inflight import Journalled
from lorabus.coordinator.phases import PhaseOutcome
from lorabus.coordinator.plan import UpdatePlan, own_names
from lorabus.schemas import (
    Ack,
    ErrorInfo,
    RankMap,
    UpdateResult,
    UpdateStatus,
    WorkerOutcome,
)


@dataclass(frozen=True)
class RunOutcome:
    """How an update's run ended."""

    result: UpdateResult
    journalled: Journalled | None
    """The in-flight record last sent for it (its writes have ended, stored
    or failed and logged), which the caller claims or clears; None if none."""
    placed: list[str] = field(default_factory=list)
    """The workers it placed the adapter on ([]: every worker: ``placement.py``)."""


@dataclass(frozen=True)
class Loaded:
    outcome: PhaseOutcome
    listed: bool
    """The frontend listed the new name by the load's end."""


@dataclass(frozen=True)
class Carried:
    """The pause that carried the load, and that load."""

    error: ErrorInfo | None
    """Why the pause failed the update (its loads not waited for), or None."""
    paused: list[str]
    """The members whose pause held."""
    errors: dict[str, ErrorInfo]
    """The members left out, and why."""
    loaded: Loaded
    """The loads among the paused (when the pause failed: what was known of them)."""


@dataclass(frozen=True)
class Window:
    """What happened inside the pause."""

    error: ErrorInfo | None
    """Why the update failed, or None: it commits if every member resumes."""
    errors: dict[str, ErrorInfo]
    """The members left out or failed, and why."""
    load: PhaseOutcome | None
    serving: list[str]
    """The members that serve the new version."""


def run_result(
    plan: UpdatePlan,
    members: Mapping[str, int],
    durations: Mapping[str, float],
    status: UpdateStatus,
    *,
    errors: Mapping[str, ErrorInfo],
    acks: Mapping[str, Ack],
    error: ErrorInfo | None = None,
    rank_map: RankMap | None = None,
) -> UpdateResult:
    """``errors``: by member; ``acks``: the load's, whose read-backs each
    member's outcome lists, of the update's own adapter: with T tenants an
    engine holds T adapters' versions, and a result of every engine's whole
    list grew with T x N (400 kB at 32 tenants and 256 workers)."""
    workers = {
        wid: WorkerOutcome(
            ok=wid not in errors,
            world_size=size,
            error=errors.get(wid),
            adapters=own_names(plan.adapter, acks[wid].adapters) if wid in acks else [],
        )
        for wid, size in sorted(members.items())
    }
    return UpdateResult(
        update_id=plan.update_id,
        status=status,
        adapter=plan.served_name,
        version=plan.version,
        rank_map=rank_map,
        phases={str(k): round(v, 6) for k, v in durations.items()},
        # What each engine's own load took: a load the pause carried is
        # inside the pause's time, and the load phase holds only what followed.
        load_s=round(max((a.duration_s for a in acks.values() if a.ok), default=0.0), 6),
        workers=workers,
        error=error,
        path=plan.path,
        digest=(
            agreed_digest(plan.digest, acks, [e.worker_id for e in rank_map.entries])
            if rank_map is not None
            else ""
        ),
    )
