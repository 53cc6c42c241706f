"""Requests to the coordinator and its answers: updates, results, status, resets.

The orchestrator asks for an update (:class:`UpdateRequest`), for an earlier
update's outcome (:class:`ResultRequest`) or the fleet's status
(:class:`StatusRequest`); the operator asks for a reset of what is committed
(:class:`ResetRequest`). Each is answered on the request's reply subject.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from lorabus.schemas.bounds import (
    Digest,
    Epoch,
    Keep,
    Labels,
    Name,
    Names,
    Path,
    Replicas,
    SeenDigest,
    UpdateId,
    Version,
    WorkerId,
    WorkerIds,
    WorldSize,
)
from lorabus.schemas.errors import ErrorInfo
from lorabus.schemas.rankmap import DataParallel, RankMap, Role, WorkerRole
from lorabus.schemas.wire import _Message


class UpdateMode(enum.StrEnum):
    PAUSE = "pause"
    """Pause every member, load, verify, resume: the new version is the only one
    served once the update commits."""
    LIVE = "live"
    """Load and verify the new versioned name on every member while engines keep
    serving; the orchestrator switches to it from the result."""


class Naming(enum.StrEnum):
    VERSIONED = "versioned"
    """Serve ``<adapter>-v<version>``: a new name per version, nothing replaced."""
    FIXED = "fixed"
    """Serve ``<adapter>``: unload then load under the same name inside the pause."""


class UpdateRequest(_Message, frozen=True, kw_only=True, tag="update_request"):
    update_id: UpdateId
    adapter: Name
    path: Path
    version: Version | None = None
    """Policy version (trainer step); None means one past the committed version."""
    digest: Digest | None = None
    """The adapter's content digest: every member must see exactly these bytes
    at ``path`` (None: members must agree among themselves)."""
    mode: UpdateMode | None = None
    """``pause`` or ``live``; None: the coordinator's ``--mode``."""
    keep: Keep | None = None
    """How many of the adapter's newest versions, this one among them, every
    engine serves (async RL with staleness K: K + 1); None: the
    coordinator's ``--keep``."""
    replicas: Replicas | None = None
    """On how many workers to place the adapter (None: on every worker the
    ``selector`` matches). The coordinator chooses them (coordinator/placement.py)."""
    selector: Labels = {}
    """Labels every worker that serves the adapter must announce ({}: any worker)."""


class UpdateStatus(enum.StrEnum):
    """Where an update stands, as an ``update_result`` says: the answer to an
    ``update_request`` is ``committed`` or ``failed``; the answer to a
    ``result_request`` may also be ``pending`` or ``unknown``.

    On the wire it is the bare string. A peer refuses a result whose status
    it does not know, so adding one needs a new wire version."""

    COMMITTED = "committed"
    """The new version is served; ``rank_map`` names the members serving it."""
    FAILED = "failed"
    """The update did not commit (or nobody answered in time); ``error`` says why."""
    PENDING = "pending"
    """Only in answer to a ``result_request``: the update is queued or running."""
    UNKNOWN = "unknown"
    """Only in answer to a ``result_request``: no coordinator record of that id
    (never asked, or its result expired after a day)."""


COMMITTED = UpdateStatus.COMMITTED
FAILED = UpdateStatus.FAILED
PENDING = UpdateStatus.PENDING
UNKNOWN = UpdateStatus.UNKNOWN


class WorkerOutcome(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    world_size: WorldSize
    error: ErrorInfo | None = None
    adapters: Names = []


class UpdateResult(_Message, frozen=True, kw_only=True, tag="update_result"):
    update_id: str
    status: UpdateStatus
    """``committed`` or ``failed`` (``pending`` or ``unknown`` too in answer to
    a ``result_request``)."""
    adapter: str
    """The served name (``<adapter>-v<version>`` with versioned naming)."""
    version: Version | None
    rank_map: RankMap | None = None
    phases: dict[str, float] = {}
    """Seconds spent in each phase that ran."""
    load_s: float = 0.0
    """The slowest member's own load, in seconds, as its ack measured it (0:
    none acked one). A load the pause carried runs inside the pause, so the
    ``load`` phase holds only what came after the fleet's pause."""
    workers: dict[str, WorkerOutcome] = {}
    error: ErrorInfo | None = None
    path: Path | None = None
    """The adapter directory the update was for, normalized (None where unknown:
    a request that did not decode, or a result stored by an older version),
    so a repeated update id is checked against the whole first content."""
    digest: SeenDigest = ""
    """Committed: the content digest every serving member saw ("" when none
    could read the directory)."""
    trimmed: Names = []
    """What was left out so that the result fits the bus's message size limit
    (docs/protocol.md, "Results and status that fit"): ``adapters`` (each
    worker's adapter list), then ``serving_workers`` (the entries of workers
    that did not fail; a committed result's rank map still names each), then ``error_detail``
    (failed workers' messages cut short). Empty: the whole result."""

    @property
    def committed(self) -> bool:
        return self.status == COMMITTED


class ResultRequest(_Message, frozen=True, kw_only=True, tag="result_request"):
    """The outcome of an earlier update, by its id alone (``lorabus result``);
    the reply is an ``update_result``, of status ``pending`` or ``unknown``
    when it has none yet."""

    update_id: UpdateId


class StatusRequest(_Message, frozen=True, kw_only=True, tag="status_request"):
    pass


class ResetRequest(_Message, frozen=True, kw_only=True, tag="reset_request"):
    """Forget what is committed for ``adapter``, so that any version may come
    next: the way out after a bogus version (a huge one, a wrong step count)
    was committed. Only the operator role may send it; the coordinator runs it
    between updates and records it in the trail (``committed_reset``).

    Engines keep what they hold. Versions committed after the reset belong to
    the next lineage: their served names differ from every earlier one
    (``<adapter>-r<lineage>-v<version>``), and the earlier ones are retired
    first, so an engine never mistakes an old version's bytes for a new one."""

    adapter: Name
    reason: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    """Why, in the operator's words: it goes into the trail."""
    expected_version: Version | None = None
    """Reset only if this is the committed version (a guard against resetting
    what another operator just changed); None: whatever is committed."""


class ResetResult(_Message, frozen=True, kw_only=True, tag="reset_result"):
    adapter: Name
    ok: bool
    lineage: Epoch = 0
    """The adapter's lineage from now on."""
    previous_version: Version | None = None
    previous_path: Annotated[str, msgspec.Meta(max_length=4096)] = ""
    error: ErrorInfo | None = None


class MemberStatus(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One live member. Fields at their default are left out on the wire (a
    reader fills them in): a status of thousands of members must fit one
    message."""

    worker_id: WorkerId
    world_size: WorldSize
    engine: str
    paused: bool
    adapters: Names
    heartbeat_age_s: float
    rank_offset: int | None = None
    ready: bool = True
    unready_reason: str = ""
    """From its last heartbeat: why it cannot load the committed adapter."""
    unreadable_state: str = ""
    """From its last heartbeat: the fleet state records in KV its agent
    ignores (unsealed, or not decoding), and why."""
    missing: Names = []
    """From its last heartbeat: the committed served names its engine lacks."""
    role: Role = WorkerRole.AGGREGATED.value
    """What the worker does in serving: aggregated, prefill or decode."""
    data_parallel: DataParallel = 1
    """Data-parallel ranks behind its engine server."""
    capacity: int | None = None
    """From its last heartbeat: the most adapters its engine holds at once."""
    labels: Labels = {}
    """From its last heartbeat: the labels placement selects workers by."""


class RunningUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """An update the leader runs now."""

    update_id: UpdateId
    adapter: Name
    live: bool = False
    """It pauses nothing (``UpdateMode.LIVE``)."""
    phase: str | None = None
    """The phase whose acks it gathers now (None: between phases)."""


class AdapterStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One adapter as the fleet serves it: its committed version, those kept
    beside it, and which live members hold each."""

    adapter: Name
    served_name: Name
    version: Version
    path: Path
    digest: SeenDigest = ""
    committed_at: float = 0.0
    """When it was committed (Unix time; 0: not said)."""
    holders: WorkerIds = []
    """The live members whose engine lists ``served_name``."""
    kept: Names = []
    """The served names of the versions kept beside it, newest first."""
    placed: WorkerIds = []
    """The workers placed to serve it and its kept versions ([]: every worker)."""


class FleetStatus(_Message, frozen=True, kw_only=True, tag="fleet_status"):
    fleet: str
    expected_world_size: int
    live_world_size: int
    members: list[MemberStatus]
    committed_adapter: str | None = None
    committed_version: Version | None = None
    rank_map: RankMap | None = None
    in_flight: str | None = None
    """The id of the update running longest, if any (``running`` lists every
    update running: those of different adapters run at once)."""
    epoch: Epoch = 0
    leader: str = ""
    in_flight_phase: str | None = None
    """The phase the ``in_flight`` update is in."""
    acked: list[str] = []
    """Members that have acked that phase so far."""
    waiting: list[str] = []
    """Members whose ack of that phase is still awaited."""
    conflicts: list[WorkerIdConflict] = []
    """Worker ids a second live agent claimed (it was refused)."""
    trimmed: Names = []
    """What was left out so that the status fits the bus's message size limit:
    ``adapters`` (each member's adapter list), then ``holders`` (each
    adapter's holders and placed workers), then ``phase_members`` (the ``acked`` and ``waiting``
    lists), then ``rank_map`` (each member still shows its rank offset),
    then ``ready_members`` (the rows of members ready and not paused:
    ``live_world_size`` still counts them). Empty: the whole status."""
    running: list[RunningUpdate] = []
    """Every update running, in the order they started."""
    adapters: list[AdapterStatus] = []
    """Every adapter the fleet has committed, by name (``committed_adapter``
    and ``committed_version`` are the latest commit's, of any adapter)."""


class WorkerIdConflict(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: WorkerId
    holder: str
    """The instance that keeps the id."""
    refused: str
    """The latest instance refused."""
    age_s: float
    """Seconds since the refused instance was last heard."""
