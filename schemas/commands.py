"""Commands: what the coordinator tells agents to do, on the fleet's command subjects.

One tagged union, :data:`Command`, for the whole family. A command reaches
an agent by name, as one of a pause's cohort, or as one of the fleet (a
committed notice): :func:`addressing_of` says which, or that it does not.
"""

from __future__ import annotations

import enum
from collections.abc import Container
from typing import Annotated

import msgspec

from lorabus.schemas.bounds import (
    Digest,
    Epoch,
    Name,
    Names,
    Path,
    Seconds,
    SeenDigest,
    UpdateId,
    UpdateIds,
    Version,
    WorkerIds,
)
from lorabus.schemas.records import KeptVersion
from lorabus.schemas.wire import Phase, _Message, tag_of


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


class PrepareCommand(_Command, frozen=True, kw_only=True, tag="prepare"):
    """Fetch the adapter at ``path`` (a ``bus:<digest>`` path: the fleet's
    object store) into this node's cache, before any engine is paused, so
    no pause window holds a transfer. Sent to the update's members as a
    cohort that this command opens (as a pause does): one broadcast, and by
    name again to those whose ack does not come."""

    path: Path
    digest: Digest


class PauseCommand(_Command, frozen=True, kw_only=True, tag="pause"):
    # No pause mode: each driver pauses as its engine allows (Dynamo keeps
    # in-flight requests, falling back to wait). A ``mode`` an older
    # coordinator sends is ignored, as every unknown field is.
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
    shared_with: UpdateIds = []
    """The other updates of its round (pause-mode updates of other adapters
    that started with it): the agent keeps its engine paused until each of
    them, and this one, has resumed it, or its lease has run out; a pause
    drops every hold it does not share with."""


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


class CanaryCommand(_Command, frozen=True, kw_only=True, tag="canary"):
    """Ask this worker's own engine for one token (greedy, a fixed prompt)
    with ``served_name``, and ack ok only when the engine answered as that
    name: what a request routed to this replica would get. Sent after the
    load in live mode and after the resume in pause mode (a paused engine
    holds generations)."""

    served_name: Name


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
    adapter: Name = ""
    """The adapter it commits ("": a version-6 coordinator's, which names none)."""
    kept: list[KeptVersion] = []
    """The adapter's earlier versions kept beside it, newest first: with it,
    what every engine serves for the adapter."""
    workers: WorkerIds = []
    """The workers placed to serve them ([]: every worker); the others
    unload the adapter's versions they hold."""


Command = (
    PrepareCommand
    | PauseCommand
    | LoadCommand
    | ResumeCommand
    | UnloadCommand
    | CanaryCommand
    | RenewLeaseCommand
    | CommittedNotice
    | RefuseInstance
)
PhasedCommand = (
    PrepareCommand | PauseCommand | LoadCommand | ResumeCommand | UnloadCommand | CanaryCommand
)


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
    if isinstance(command, PauseCommand | PrepareCommand) and command.cohort:
        # The pause (or prepare) that opens the cohort.
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
