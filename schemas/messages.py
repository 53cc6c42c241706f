"""The wire contract: every message lorabus sends, as msgspec Structs.

Each subject family has one tagged union (``type`` is the tag) so a receiver
decodes with one reused Decoder and dispatches with ``match``. Every message has
a version field ``v``; new fields get defaults and field types never change, so
an older peer ignores what it does not know (msgspec drops unknown fields).
"""

from __future__ import annotations

import enum
from collections.abc import Container
from typing import Annotated

import msgspec

from lorabus.schemas.bounds import (
    Digest,
    Epoch,
    Interval,
    Name,
    Names,
    Path,
    Seconds,
    SeenDigest,
    Text,
    UpdateId,
    Version,
    WorkerId,
    WorkerIds,
    WorldSize,
)
from lorabus.schemas.errors import ErrorInfo
from lorabus.schemas.rankmap import RankMap

WIRE_VERSION = 5
"""2: commands address a pause's cohort and committed notices reach every
agent; a version-1 agent acts only on commands that name it, so in an
upgrade the agents go first and the coordinators last.
3: a pause carries the load that follows it (``PauseCommand.then_load``); a
version-2 agent only pauses, and loads when the load is sent again by name,
at its first re-send.
4: a pause carrying a load may ask for the pause's ack to come with the
load's (``LoadSpec.ack_hold_s``, ``Ack.with_pause``); a version-3 agent acks
both on their own, as before.
5: a command sent to one worker by name names the agent process it is for
(``instance``), and an agent that checks signatures refuses one of this
version for another process, or for none, so that no command captured
before it started can drive it; it takes a named command without one from
a version-4 coordinator, so in an upgrade the agents still go first."""

INSTANCE_BOUND_SINCE = 5
"""The wire version from which a command sent by name carries ``instance``."""


class Phase(enum.StrEnum):
    """The phases of one update, in the order they run."""

    QUORUM = "quorum"
    PAUSE = "pause"
    LOAD = "load"
    VERIFY = "verify"
    RESUME = "resume"
    UNLOAD = "unload"


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


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = WIRE_VERSION


# -- commands: coordinator -> agents ------------------------------------------


class _Command(_Message, frozen=True, kw_only=True):
    update_id: UpdateId
    targets: WorkerIds = []
    """Worker ids that must act; every other agent ignores the command."""
    cohort: bool = False
    """Also addressed: every agent that took this update's pause of the same
    epoch, less ``excluded``. A pause with ``cohort`` opens the cohort: every
    agent less ``excluded`` may take it, and an agent takes it only if a pause
    of the same epoch named it before and it is ready (agents/agent.py).
    So the member list never crosses the bus: each agent reads every
    broadcast, and a list in each would cost the fleet N x N per phase."""
    excluded: WorkerIds = []
    budget_s: Seconds
    """How long the agent has, counted from when it receives the command."""
    epoch: Epoch = 0
    """The sending coordinator's term; agents refuse commands of an older term."""
    instance: Annotated[str, msgspec.Meta(max_length=64)] = ""
    """The agent process a command sent by name is for: the instance the
    coordinator last heard beat with that worker id ("" on a command to the
    fleet or a cohort). An agent refuses a named command for another process
    (docs/protocol.md, "Replays"): nothing captured before it started names it."""


class LoadSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The load a pause carries: what :class:`LoadCommand` says besides its
    addressing, with its own budget, counted from when the pause is done."""

    served_name: Name
    path: Path
    replace: bool = False
    digest: Digest | None = None
    budget_s: Seconds
    ack_hold_s: Seconds = 0.0
    """Up to this long after the pause arrived (and at most half the pause's
    budget), the agent holds an ok pause's ack and sends it inside the load's
    (:attr:`Ack.with_pause`): one message to the coordinator fewer per member
    and update. A load still running then gets its pause acked on its own.
    0: ack the pause at once."""


class PauseCommand(_Command, frozen=True, kw_only=True, tag="pause"):
    mode: Annotated[str, msgspec.Meta(max_length=32)] = "keep"
    lease_s: Seconds = 0.0
    """The agent resumes on its own unless renewed or resumed within this (0: the
    agent's own ``--max-pause-lease``); agents also cap it with that limit and
    raise it to their minimum."""
    then_load: LoadSpec | None = None
    """Load this as soon as this engine is paused, without waiting for the rest
    of the fleet's pause: one message and one round of the bus fewer per
    update. The agent acks the pause, then the load (as a :class:`LoadCommand`
    with ``after_pause``), or both in one ack (``then_load.ack_hold_s``); a
    failed pause fails the load too, and is acked at once."""


class LoadCommand(_Command, frozen=True, kw_only=True, tag="load"):
    served_name: Name
    path: Path
    replace: bool = False
    """Unload ``served_name`` first if the engine has it (fixed naming)."""
    digest: Digest | None = None
    """The content digest the request asked for: the agent refuses to load a
    directory whose digest differs (``digest_mismatch``)."""
    after_pause: bool = False
    """Only on an engine paused by this update's pause: an agent that has not
    taken that pause, or whose pause failed or no longer holds, refuses it
    (``not_paused``)."""

    def spec(self) -> LoadSpec:
        return LoadSpec(
            served_name=self.served_name,
            path=self.path,
            replace=self.replace,
            digest=self.digest,
            budget_s=self.budget_s,
        )


class ResumeCommand(_Command, frozen=True, kw_only=True, tag="resume"):
    pass


class UnloadCommand(_Command, frozen=True, kw_only=True, tag="unload"):
    names: Names


class RenewLeaseCommand(_Command, frozen=True, kw_only=True, tag="renew_lease"):
    """Extends the pause lease of the targets; not acked (the next one, or a
    resume, follows soon, and a lost one only shortens the lease)."""

    lease_s: Seconds


class RefuseInstance(_Command, frozen=True, kw_only=True, tag="refuse_instance"):
    """Tells the agent process ``instance`` that another live agent holds its
    worker id: it stops with a ``duplicate_worker`` error. Every other agent,
    the holder included, ignores it."""

    instance: Annotated[str, msgspec.Meta(max_length=64)]
    """The refused process (required here, as it always was)."""
    holder: Annotated[str, msgspec.Meta(max_length=64)]


class CommittedNotice(_Command, frozen=True, kw_only=True, tag="committed"):
    """What the fleet now serves: an agent that lacks it (a restarted engine,
    a member left out of a partial commit) loads it before counting as ready.
    Addressed to every agent of the fleet, whatever its ``targets``."""

    served_name: Name
    path: Path
    version: Version
    retire: Names = []
    """Older versions beyond the coordinator's ``keep``: an agent unloads those
    its engine holds, after the update has been answered (not acked; a
    ``command_handled`` event of phase ``unload`` reports it)."""
    lineage: Epoch = 0
    """How many times an operator reset this adapter's committed state: a
    notice of a later lineage replaces one of an earlier, whatever the
    versions (see ``ResetRequest``)."""
    digest: SeenDigest = ""
    """The content digest the members saw when it was committed ("" when none
    could read the directory): an agent reloading it refuses a directory that
    now holds other bytes (``digest_mismatch``)."""


Command = (
    PauseCommand
    | LoadCommand
    | ResumeCommand
    | UnloadCommand
    | RenewLeaseCommand
    | CommittedNotice
    | RefuseInstance
)
PhasedCommand = PauseCommand | LoadCommand | ResumeCommand | UnloadCommand


def tag_of(message: msgspec.Struct) -> str:
    """The ``type`` tag a message is sent with (a command's tag is its phase)."""
    tag = type(message).__struct_config__.tag
    assert isinstance(tag, str), "every wire message has a string tag"
    return tag


class Addressing(enum.Enum):
    """How a command reaches one agent."""

    FLEET = "fleet"
    """A committed notice: every agent."""
    COHORT = "cohort"
    """A broadcast to a pause's cohort, or the broadcast pause that opens it."""
    NAME = "name"
    """Its ``targets`` name the worker."""


def addressing_of(
    command: Command, worker_id: str, cohort_of: Container[tuple[int, str]]
) -> Addressing | None:
    """How ``command`` reaches ``worker_id`` (None: it does not, and the
    agent ignores it); ``cohort_of`` holds the (epoch, update id) of every
    pause that worker took."""
    if isinstance(command, CommittedNotice):
        return Addressing.FLEET
    if isinstance(command, PauseCommand) and command.cohort:
        # The pause that opens the cohort.
        return None if worker_id in command.excluded else Addressing.COHORT
    if (
        command.cohort
        and (command.epoch, command.update_id) in cohort_of
        and worker_id not in command.excluded
    ):
        return Addressing.COHORT
    return Addressing.NAME if worker_id in command.targets else None


def is_addressed_to(
    command: Command, worker_id: str, cohort_of: Container[tuple[int, str]]
) -> bool:
    """Whether ``worker_id`` must act on ``command``; ``cohort_of`` holds the
    (epoch, update id) of every pause that worker took."""
    return addressing_of(command, worker_id, cohort_of) is not None


def acks_in(ack: Ack) -> list[Ack]:
    """The acks one ack message stands for, in the order they happened: a
    load's ack with ``with_pause`` stands for its update's ok pause first."""
    if not (ack.with_pause and ack.phase is Phase.LOAD):
        return [ack]
    paused = msgspec.structs.replace(
        ack,
        phase=Phase.PAUSE,
        ok=True,
        paused=True,
        error=None,
        duration_s=ack.pause_s,
        digest="",
        with_pause=False,
        pause_s=0.0,
    )
    return [paused, ack]


def carried_load(pause: PauseCommand, spec: LoadSpec) -> LoadCommand:
    """The load ``pause`` carries, as the command its agent runs and acks."""
    return LoadCommand(
        update_id=pause.update_id,
        targets=pause.targets,
        cohort=pause.cohort,
        excluded=pause.excluded,
        budget_s=spec.budget_s,
        epoch=pause.epoch,
        served_name=spec.served_name,
        path=spec.path,
        replace=spec.replace,
        digest=spec.digest,
        after_pause=True,
    )


def phase_of(command: PhasedCommand) -> Phase:
    return Phase(tag_of(command))


# -- agent -> coordinator -----------------------------------------------------


class Ack(_Message, frozen=True, kw_only=True, tag="ack"):
    update_id: UpdateId
    phase: Phase
    worker_id: WorkerId
    """Must equal the worker id of the subject it came on."""
    ok: bool
    world_size: WorldSize
    adapters: Names
    """The engine's adapter list as last read back."""
    paused: bool
    error: ErrorInfo | None = None
    duration_s: Seconds = 0.0
    epoch: Epoch = 0
    """The epoch of the command this acks."""
    instance: Annotated[str, msgspec.Meta(max_length=64)] = ""
    """The agent process's instance id (as in its heartbeats): the coordinator
    counts only the acks of the instance that holds the worker id."""
    digest: SeenDigest = ""
    """A load's ack: the content digest of the directory as this agent's host
    shows it ("" when it could not read it, or for other phases)."""
    with_pause: bool = False
    """A load's ack that acks its update's pause too: the engine paused (ok,
    in ``pause_s``), then this load ran (:attr:`LoadSpec.ack_hold_s`)."""
    pause_s: Seconds = 0.0


class Heartbeat(_Message, frozen=True, kw_only=True, tag="heartbeat"):
    worker_id: WorkerId
    """Must equal the worker id of the subject it came on."""
    world_size: WorldSize
    engine: Annotated[str, msgspec.Meta(max_length=32)]
    adapters: Names
    paused: bool
    interval_s: Interval
    """The agent's beat period; it counts as gone after three missed beats. The
    coordinator accepts only periods within its own range."""
    ready: bool = True
    """False while the agent brings its engine to the committed state."""
    epoch_seen: Epoch = 0
    """The highest coordinator term this agent has seen."""
    instance: Annotated[str, msgspec.Meta(max_length=64)] = ""
    """Random per agent process: two live agents with one worker id differ here."""
    unready_reason: Text = ""
    """Why the engine cannot load the committed adapter, once loading it has
    failed repeatedly ("" while it converges or is ready): a member that will
    not become ready on its own."""
    unreadable_state: Text = ""
    """The fleet state records in KV (``leader``, ``committed``) that did not
    decode at this agent's latest read of each, and why ("": every record it
    read decoded). The agent ignores such a record: it keeps the epoch and the
    committed state it knew, and waits for a writer to replace it."""


# -- orchestrator <-> coordinator ---------------------------------------------


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


class WorkerOutcome(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    world_size: WorldSize
    error: ErrorInfo | None = None
    adapters: Names = []


class UpdateResult(_Message, frozen=True, kw_only=True, tag="update_result"):
    update_id: str
    status: str
    """``committed`` or ``failed``."""
    adapter: str
    """The served name (``<adapter>-v<version>`` with versioned naming)."""
    version: Version | None
    rank_map: RankMap | None = None
    phases: dict[str, float] = {}
    """Seconds spent in each phase that ran."""
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


COMMITTED = "committed"
FAILED = "failed"
PENDING = "pending"
"""Only in answer to a ``result_request``: the update is queued or running."""
UNKNOWN = "unknown"
"""Only in answer to a ``result_request``: no coordinator record of that id
(never asked, or its result expired after a day)."""


class ResultRequest(_Message, frozen=True, kw_only=True, tag="result_request"):
    """The outcome of an earlier update, by its id alone (``lorabus result``);
    the reply is an ``update_result``, of status ``pending`` or ``unknown``
    when it has none yet."""

    update_id: UpdateId


class StatusRequest(_Message, frozen=True, kw_only=True, tag="status_request"):
    pass


# -- operator <-> coordinator ---------------------------------------------------


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


class MemberStatus(msgspec.Struct, frozen=True, kw_only=True):
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


class FleetStatus(_Message, frozen=True, kw_only=True, tag="fleet_status"):
    fleet: str
    expected_world_size: int
    live_world_size: int
    members: list[MemberStatus]
    committed_adapter: str | None = None
    committed_version: Version | None = None
    rank_map: RankMap | None = None
    in_flight: str | None = None
    """The update id being run now, if any."""
    epoch: Epoch = 0
    leader: str = ""
    in_flight_phase: str | None = None
    """The phase the update in flight is in."""
    acked: list[str] = []
    """Members that have acked that phase so far."""
    waiting: list[str] = []
    """Members whose ack of that phase is still awaited."""
    conflicts: list[WorkerIdConflict] = []
    """Worker ids a second live agent claimed (it was refused)."""
    trimmed: Names = []
    """What was left out so that the status fits the bus's message size limit:
    ``adapters`` (each member's adapter list), then ``phase_members`` (the
    ``acked`` and ``waiting`` lists), then ``rank_map`` (each member still
    shows its rank offset). Empty: the whole status."""


class WorkerIdConflict(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: WorkerId
    holder: str
    """The instance that keeps the id."""
    refused: str
    """The latest instance refused."""
    age_s: float
    """Seconds since the refused instance was last heard."""


# -- events: anyone -> the audit tap ------------------------------------------


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


class LeaderElected(_Event, frozen=True, kw_only=True, tag="leader_elected"):
    holder: str
    epoch: Epoch
    recovered: str | None = None
    """The update id found in flight and rolled back, if any."""


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
)


# -- durable state (JetStream KV), written by the active coordinator ---------


class LeaderRecord(msgspec.Struct, frozen=True, kw_only=True):
    holder: str
    epoch: Epoch
    signing_key: str = ""
    """The public key this leader signs its commands with ("": it does not sign)."""


class CommittedRecord(msgspec.Struct, frozen=True, kw_only=True):
    adapter: str
    version: Version
    path: str
    served_name: str
    rank_map: RankMap
    lineage: Epoch = 0
    """The adapter's lineage when this was committed (see ``ResetRequest``)."""
    digest: str = ""
    """The content digest the members saw (see ``UpdateResult.digest``)."""


class ResetRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The latest reset of an adapter's committed state: its lineage outlives
    the committed record it removed, for the next commit and a successor."""

    adapter: str
    lineage: Epoch
    previous_version: Version
    previous_path: str
    reason: str
    ts: float


class InflightRecord(msgspec.Struct, frozen=True, kw_only=True):
    update_id: str
    epoch: Epoch
    phase: Phase
    adapter: str
    served_name: str
    version: Version
    members: dict[str, int]
    """The membership snapshot: everyone here may have been told to pause."""
    path: str = ""
    """The adapter directory, for the result a successor records."""
