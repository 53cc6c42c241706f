"""The wire contract: every message lorabus sends, as msgspec Structs.

Each subject family has one tagged union (``type`` is the tag) so a receiver
decodes with one reused Decoder and dispatches with ``match``. Every message has
a version field ``v``; new fields get defaults and field types never change, so
an older peer ignores what it does not know (msgspec drops unknown fields).
"""

from __future__ import annotations

import enum
from collections.abc import Container

import msgspec

from lorabus.schemas.errors import ErrorInfo
from lorabus.schemas.rankmap import RankMap

WIRE_VERSION = 2
"""2: commands address a pause's cohort and committed notices reach every
agent; a version-1 agent acts only on commands that name it, so in an
upgrade the agents go first and the coordinators last."""


class Phase(enum.StrEnum):
    """The phases of one update, in the order they run."""

    QUORUM = "quorum"
    PAUSE = "pause"
    LOAD = "load"
    VERIFY = "verify"
    RESUME = "resume"
    UNLOAD = "unload"


class Naming(enum.StrEnum):
    VERSIONED = "versioned"
    """Serve ``<adapter>-v<version>``: a new name per version, nothing replaced."""
    FIXED = "fixed"
    """Serve ``<adapter>``: unload then load under the same name inside the pause."""


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    v: int = WIRE_VERSION


# -- commands: coordinator -> agents ------------------------------------------


class _Command(_Message, frozen=True, kw_only=True):
    update_id: str
    targets: list[str] = []
    """Worker ids that must act; every other agent ignores the command."""
    cohort: bool = False
    """Also addressed: every agent that took this update's pause of the same
    epoch, less ``excluded``.
    The member list then crosses the bus once per update (in the pause), not
    once per command: each agent reads every broadcast, so a list in each
    would cost the fleet N x N per phase."""
    excluded: list[str] = []
    budget_s: float
    """How long the agent has, counted from when it receives the command."""
    epoch: int = 0
    """The sending coordinator's term; agents refuse commands of an older term."""


class PauseCommand(_Command, frozen=True, kw_only=True, tag="pause"):
    mode: str = "keep"
    lease_s: float = 0.0
    """The agent resumes on its own unless renewed or resumed within this (0: never)."""


class LoadCommand(_Command, frozen=True, kw_only=True, tag="load"):
    served_name: str
    path: str
    replace: bool = False
    """Unload ``served_name`` first if the engine has it (fixed naming)."""


class ResumeCommand(_Command, frozen=True, kw_only=True, tag="resume"):
    pass


class UnloadCommand(_Command, frozen=True, kw_only=True, tag="unload"):
    names: list[str]


class RenewLeaseCommand(_Command, frozen=True, kw_only=True, tag="renew_lease"):
    """Extends the pause lease of the targets; not acked (the next one, or a
    resume, follows soon, and a lost one only shortens the lease)."""

    lease_s: float


class CommittedNotice(_Command, frozen=True, kw_only=True, tag="committed"):
    """What the fleet now serves: an agent that lacks it (a restarted engine,
    a member left out of a partial commit) loads it before counting as ready.
    Addressed to every agent of the fleet, whatever its ``targets``."""

    served_name: str
    path: str
    version: int
    retire: list[str] = []
    """Older versions beyond the coordinator's ``keep``: an agent unloads those
    its engine holds, after the update has been answered (not acked; a
    ``command_handled`` event of phase ``unload`` reports it)."""


Command = (
    PauseCommand | LoadCommand | ResumeCommand | UnloadCommand | RenewLeaseCommand | CommittedNotice
)
PhasedCommand = PauseCommand | LoadCommand | ResumeCommand | UnloadCommand


def tag_of(message: msgspec.Struct) -> str:
    """The ``type`` tag a message is sent with (a command's tag is its phase)."""
    tag = type(message).__struct_config__.tag
    assert isinstance(tag, str), "every wire message has a string tag"
    return tag


def is_addressed_to(
    command: Command, worker_id: str, cohort_of: Container[tuple[int, str]]
) -> bool:
    """Whether ``worker_id`` must act on ``command``; ``cohort_of`` holds the
    (epoch, update id) of every pause that worker took."""
    if isinstance(command, CommittedNotice):
        return True
    if (
        command.cohort
        and (command.epoch, command.update_id) in cohort_of
        and worker_id not in command.excluded
    ):
        return True
    return worker_id in command.targets


def phase_of(command: PhasedCommand) -> Phase:
    return Phase(tag_of(command))


# -- agent -> coordinator -----------------------------------------------------


class Ack(_Message, frozen=True, kw_only=True, tag="ack"):
    update_id: str
    phase: Phase
    worker_id: str
    ok: bool
    world_size: int
    adapters: list[str]
    """The engine's adapter list as last read back."""
    paused: bool
    error: ErrorInfo | None = None
    duration_s: float = 0.0
    epoch: int = 0
    """The epoch of the command this acks."""


class Heartbeat(_Message, frozen=True, kw_only=True, tag="heartbeat"):
    worker_id: str
    world_size: int
    engine: str
    adapters: list[str]
    paused: bool
    interval_s: float
    """The agent's beat period; it counts as gone after three missed beats."""
    ready: bool = True
    """False while the agent brings its engine to the committed state."""
    epoch_seen: int = 0
    """The highest coordinator term this agent has seen."""


# -- orchestrator <-> coordinator ---------------------------------------------


class UpdateRequest(_Message, frozen=True, kw_only=True, tag="update_request"):
    update_id: str
    adapter: str
    path: str
    version: int | None = None
    """Policy version (trainer step); None means one past the committed version."""


class WorkerOutcome(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    world_size: int
    error: ErrorInfo | None = None
    adapters: list[str] = []


class UpdateResult(_Message, frozen=True, kw_only=True, tag="update_result"):
    update_id: str
    status: str
    """``committed`` or ``failed``."""
    adapter: str
    """The served name (``<adapter>-v<version>`` with versioned naming)."""
    version: int | None
    rank_map: RankMap | None = None
    phases: dict[str, float] = {}
    """Seconds spent in each phase that ran."""
    workers: dict[str, WorkerOutcome] = {}
    error: ErrorInfo | None = None

    @property
    def committed(self) -> bool:
        return self.status == COMMITTED


COMMITTED = "committed"
FAILED = "failed"


class StatusRequest(_Message, frozen=True, kw_only=True, tag="status_request"):
    pass


class MemberStatus(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    world_size: int
    engine: str
    paused: bool
    adapters: list[str]
    heartbeat_age_s: float
    rank_offset: int | None = None
    ready: bool = True


class FleetStatus(_Message, frozen=True, kw_only=True, tag="fleet_status"):
    fleet: str
    expected_world_size: int
    live_world_size: int
    members: list[MemberStatus]
    committed_adapter: str | None = None
    committed_version: int | None = None
    rank_map: RankMap | None = None
    in_flight: str | None = None
    """The update id being run now, if any."""
    epoch: int = 0
    leader: str = ""
    in_flight_phase: str | None = None
    """The phase the update in flight is in."""
    acked: list[str] = []
    """Members that have acked that phase so far."""
    waiting: list[str] = []
    """Members whose ack of that phase is still awaited."""


# -- events: anyone -> the audit tap ------------------------------------------


class _Event(_Message, frozen=True, kw_only=True):
    ts: float
    """Unix time at the emitter."""
    source: str
    """``coordinator`` or ``agent:<worker_id>``."""
    epoch: int = 0
    """The coordinator term the event belongs to (for an agent: of the command)."""


class UpdateStarted(_Event, frozen=True, kw_only=True, tag="update_started"):
    update_id: str
    adapter: str
    version: int
    members: dict[str, int]


class PhaseFinished(_Event, frozen=True, kw_only=True, tag="phase_finished"):
    update_id: str
    phase: Phase
    ok: bool
    duration_s: float
    missing: list[str] = []
    failed: list[str] = []


class UpdateFinished(_Event, frozen=True, kw_only=True, tag="update_finished"):
    update_id: str
    status: str
    error: ErrorInfo | None = None
    adapter: str = ""
    """The served name."""
    rank_map: RankMap | None = None
    """Committed: the members that serve the new version, with their ranks."""


class CommandHandled(_Event, frozen=True, kw_only=True, tag="command_handled"):
    update_id: str
    phase: Phase
    worker_id: str
    ok: bool
    error: ErrorInfo | None = None


class BadMessage(_Event, frozen=True, kw_only=True, tag="bad_message"):
    subject: str
    error: str
    size: int


class CommandRefused(_Event, frozen=True, kw_only=True, tag="command_refused"):
    update_id: str
    worker_id: str
    command: str
    epoch: int
    epoch_seen: int


class LeaseExpired(_Event, frozen=True, kw_only=True, tag="lease_expired"):
    update_id: str
    worker_id: str
    resumed: bool
    error: ErrorInfo | None = None


class Reconciled(_Event, frozen=True, kw_only=True, tag="reconciled"):
    worker_id: str
    served_name: str
    ok: bool
    error: ErrorInfo | None = None


class EngineResumed(_Event, frozen=True, kw_only=True, tag="engine_resumed"):
    """An agent resumed its engine outside any update: at start (its predecessor
    may have died with the engine paused) or on its way out."""

    worker_id: str
    reason: str


class LeaderElected(_Event, frozen=True, kw_only=True, tag="leader_elected"):
    holder: str
    epoch: int
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
)


# -- durable state (JetStream KV), written by the active coordinator ---------


class LeaderRecord(msgspec.Struct, frozen=True, kw_only=True):
    holder: str
    epoch: int


class CommittedRecord(msgspec.Struct, frozen=True, kw_only=True):
    adapter: str
    version: int
    path: str
    served_name: str
    rank_map: RankMap


class InflightRecord(msgspec.Struct, frozen=True, kw_only=True):
    update_id: str
    epoch: int
    phase: Phase
    adapter: str
    served_name: str
    version: int
    members: dict[str, int]
    """The membership snapshot: everyone here may have been told to pause."""
