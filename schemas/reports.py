"""What agents report to the coordinator: acks of commands, and heartbeats.

An ack answers one command of one update (a load's ack may stand for its
pause's too: :func:`acks_in`); a heartbeat says, once per beat period, that
an agent is alive, what its engine holds and whether it is ready.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from lorabus.schemas.bounds import (
    Capacity,
    Epoch,
    Interval,
    Labels,
    Names,
    Seconds,
    SeenDigest,
    Text,
    UpdateId,
    WorkerId,
    WorldSize,
)
from lorabus.schemas.errors import ErrorInfo
from lorabus.schemas.rankmap import DataParallel, Role, WorkerRole
from lorabus.schemas.wire import Phase, _Message


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
    capacity: Capacity | None = None
    """The most adapters its engine holds at once (the agent's
    ``--max-adapters``, or what the engine says of itself, the smaller):
    the coordinator never has it hold more. None: not bounded, as far as
    the agent knows."""
    labels: Labels = {}
    """The worker's labels (the agent's ``--label``), which an update's
    ``selector`` chooses workers by: zone, engine, GPU type."""
    role: Role = WorkerRole.AGGREGATED.value
    """What the worker does in serving: both phases, or disaggregated
    serving's prefill or decode (``lorabus agent --role``)."""
    data_parallel: DataParallel = 1
    """Data-parallel ranks behind the worker's engine server, as the engine
    says (vLLM ``--data-parallel-size``); ``world_size`` counts them all."""
    missing: Names = []
    """The served names of the fleet's committed state (every adapter's
    committed version and those kept beside it) that the engine lacks, as
    the agent last looked (at most ``MISSING_SHOWN``): why it is not ready
    while it converges, before ``unready_reason`` says it will not on its own."""


MISSING_SHOWN = 64
"""The most missing served names a heartbeat names."""

MAX_NODE_WORKERS = 64
"""The most workers one node agent drives, and so the most acks or beats one
node message carries (a node of 8 GPUs runs at most 8 engines; room is left
for CPU-only or many-small-engine nodes)."""


class NodeAcks(_Message, frozen=True, kw_only=True, tag="node_acks"):
    """Acks of several workers of one node agent, sent together: what its
    workers answered within one short linger (:mod:`lorabus.agents.node`),
    so the coordinator reads one message per node and phase, not per worker."""

    node: WorkerId
    """Must equal the node of the subject it came on."""
    acks: Annotated[list[Ack], msgspec.Meta(min_length=1, max_length=MAX_NODE_WORKERS)]
    """Each as a worker's own ack; each worker must belong to the node."""


class NodeBeats(_Message, frozen=True, kw_only=True, tag="node_beats"):
    """Heartbeats of several workers of one node agent, sent together."""

    node: WorkerId
    """Must equal the node of the subject it came on."""
    beats: Annotated[list[Heartbeat], msgspec.Meta(min_length=1, max_length=MAX_NODE_WORKERS)]
    """Each as a worker's own heartbeat; each worker must belong to the node."""


AckMessage = Ack | NodeAcks
"""What arrives on an ack subject: a worker's ack, or a node agent's (on the
subject of the node's name, which names no worker)."""
BeatMessage = Heartbeat | NodeBeats
"""What arrives on a heartbeat subject: a worker's beat, or a node agent's."""


def reports_of(message: Ack | NodeAcks | Heartbeat | NodeBeats) -> list[Any]:
    """The workers' own acks or beats a message carries, in the order sent."""
    if isinstance(message, NodeAcks):
        return list(message.acks)
    if isinstance(message, NodeBeats):
        return list(message.beats)
    return [message]


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
