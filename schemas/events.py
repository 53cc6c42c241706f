"""Events: what happened, told by anyone to the audit tap and whoever listens.

The coordinator reports each update's start, phases and end, elections and
alerts; agents report what they did and refused. One tagged union,
:data:`Event`, for the whole family; the audit stream keeps every one, beside
the commands and acks.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from lorabus.schemas.bounds import (
    Epoch,
    Name,
    Seconds,
    Text,
    UpdateId,
    Version,
    WorkerId,
)
from lorabus.schemas.errors import ErrorInfo
from lorabus.schemas.rankmap import RankMap
from lorabus.schemas.wire import Phase, _Message


class _Event(_Message, frozen=True, kw_only=True):
    ts: float
    """Unix time at the emitter."""
    source: Annotated[str, msgspec.Meta(max_length=80)]
    """``coordinator`` or ``agent:<worker_id>``."""
    epoch: Epoch = 0
    """The coordinator term the event belongs to (for an agent: of the command)."""


class UpdateStarted(_Event, frozen=True, kw_only=True, tag="update_started"):
    update_id: UpdateId
    adapter: str
    version: Version
    members: dict[str, int]


class PhaseFinished(_Event, frozen=True, kw_only=True, tag="phase_finished"):
    update_id: UpdateId
    phase: Phase
    ok: bool
    duration_s: Seconds
    missing: list[str] = []
    failed: list[str] = []


class UpdateFinished(_Event, frozen=True, kw_only=True, tag="update_finished"):
    update_id: UpdateId
    status: str
    error: ErrorInfo | None = None
    adapter: str = ""
    """The served name."""
    rank_map: RankMap | None = None
    """Committed: the members that serve the new version, with their ranks."""


class CommandHandled(_Event, frozen=True, kw_only=True, tag="command_handled"):
    update_id: UpdateId
    phase: Phase
    worker_id: WorkerId
    ok: bool
    error: ErrorInfo | None = None


class BadMessage(_Event, frozen=True, kw_only=True, tag="bad_message"):
    subject: Text
    error: Text
    """Why it was dropped; whatever the message claimed is quoted, escaped."""
    size: int


class CommandRefused(_Event, frozen=True, kw_only=True, tag="command_refused"):
    update_id: UpdateId
    worker_id: WorkerId
    command: Annotated[str, msgspec.Meta(max_length=32)]
    epoch: Epoch
    epoch_seen: Epoch
    reason: Text = ""
    """Why: an older epoch, an epoch no leader record shows, or a signature check."""


class LeaseExpired(_Event, frozen=True, kw_only=True, tag="lease_expired"):
    update_id: UpdateId
    worker_id: WorkerId
    resumed: bool
    error: ErrorInfo | None = None


class Reconciled(_Event, frozen=True, kw_only=True, tag="reconciled"):
    worker_id: WorkerId
    served_name: str
    ok: bool
    error: ErrorInfo | None = None


class EngineResumed(_Event, frozen=True, kw_only=True, tag="engine_resumed"):
    """An agent resumed its engine outside any update: at start (its predecessor
    may have died with the engine paused) or on its way out."""

    worker_id: WorkerId
    reason: Text


class WorkerConflict(_Event, frozen=True, kw_only=True, tag="worker_conflict"):
    """A second live agent claimed a worker id: the first holder keeps it, the
    newcomer is told to stop (and does), and is left out of the membership."""

    worker_id: WorkerId
    holder: Annotated[str, msgspec.Meta(max_length=64)]
    """The instance that keeps the id."""
    refused: Annotated[str, msgspec.Meta(max_length=64)]
    """The instance refused."""
    world_sizes: list[int] = []
    """The holder's and the newcomer's world sizes."""


class CommittedReset(_Event, frozen=True, kw_only=True, tag="committed_reset"):
    """An operator reset what was committed for ``adapter`` (``ResetRequest``)."""

    adapter: Name
    lineage: Epoch
    previous_version: Version
    previous_path: Annotated[str, msgspec.Meta(max_length=4096)]
    previous_served_name: Name
    reason: Annotated[str, msgspec.Meta(max_length=1024)]


class MemberAlert(_Event, frozen=True, kw_only=True, tag="member_alert"):
    """The leader raises (or clears) a member that needs a person's look: an
    engine paused while no update is in flight, or one not ready."""

    worker_id: WorkerId
    condition: Annotated[str, msgspec.Meta(max_length=32)]
    """``paused_outside_update`` or ``not_ready``."""
    reason: Text
    cleared: bool = False
    """True: the condition no longer holds."""


class RequestRefused(_Event, frozen=True, kw_only=True, tag="request_refused"):
    """The leader refused a tenant's request before acting on it: not the
    tenant's adapter or update id, or past one of its quotas."""

    tenant: Annotated[str, msgspec.Meta(max_length=64)]
    """As its request's subject names it (which only it may publish on)."""
    kind: Annotated[str, msgspec.Meta(max_length=16)]
    """``update`` or ``result``."""
    update_id: UpdateId
    adapter: Annotated[str, msgspec.Meta(max_length=128)] = ""
    error: ErrorInfo


class LeaderElected(_Event, frozen=True, kw_only=True, tag="leader_elected"):
    holder: str
    epoch: Epoch
    recovered: str | None = None
    """The update ids found in flight and finished or rolled back, if any,
    separated by ", " (updates of different adapters run at once)."""


Event = (
    UpdateStarted
    | PhaseFinished
    | UpdateFinished
    | CommandHandled
    | BadMessage
    | CommandRefused
    | LeaseExpired
    | Reconciled
    | LeaderElected
    | EngineResumed
    | WorkerConflict
    | CommittedReset
    | MemberAlert
    | RequestRefused
)
