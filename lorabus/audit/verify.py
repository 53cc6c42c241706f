"""Checking a fleet's audit trail against lorabus's promises.

A trail is what the audit stream captured (commands, acks, events), in stream
order; ``lorabus tap --out`` writes it as JSON lines. ``verify`` replays it
and reports every place where a promise was broken, with the records that
show it:

- ``unresumed_pause``: an engine paused (ok pause ack) that neither a resume
  ack, nor a lease expiry, nor a resume by a restarting agent followed (a
  resume ack that says the engine is still paused, held by another update of
  its round, ends only its own update's pause);
- ``load_not_acked``: a committed update serving a member that never acked
  the load ok;
- ``stale_epoch_acted``: an agent process acting on (acking ok) a command of
  an older epoch than one it had already seen;
- ``rank_map_mismatch``: a committed rank map that does not follow from the
  update's membership (order, offsets, sizes, group size), or an update
  answered from the committed record with a rank map other than the one the
  trail shows committed;
- ``no_terminal_result``: an update that started and never finished;
- ``subject_mismatch``: a record whose body disagrees with its subject (an ack
  or agent event claiming another worker, an event of another kind or
  source, a command of a type never sent on that subject);
- ``poison_record``: a payload that is no valid message for its subject.

Nothing a message claims is taken on trust. The subject says who sent it
(the server's permissions pin each identity to its subjects); a body that
disagrees is reported and not replayed, so an ack on one worker's subject
can never count for another. Every payload is decoded by the wire contract's
readers, which turn any malformed input into one ``BadPayload``: such a
record is kept as a *poison* record (its reason, size and an escaped
excerpt, never its body) and counted as a violation, and the rest of the
trail is checked as usual.

Epochs are judged per agent process, as an agent fences them: a restarted
agent knows only what it read from the leader record at start. A process
begins at its ``engine_resumed`` event of reason ``agent start`` (whose epoch
is the one it started with), or at an ack from an instance id not seen
before; a process of a fleet whose state was reset may then act on lower
epochs than its predecessor without a violation.

An update answered "already committed" runs no phase: its ``update_finished``
has no ``update_started`` before it. It is checked against the trail's
latest commit of the same served name instead of against load acks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from lorabus.audit.render import printable
from lorabus.schemas import (
    COMMITTED,
    Ack,
    BadPayload,
    CommandRefused,
    EngineResumed,
    LeaseExpired,
    NodeAcks,
    Phase,
    RankMap,
    Reader,
    UpdateFinished,
    UpdateStarted,
    ack_message_decoder,
    acks_in,
    command_decoder,
    event_decoder,
    tag_of,
)
from lorabus.schemas.nodes import NodeRoster

DEFAULT_PREFIX = "lorabus"
AGENT_START = "agent start"
"""The reason of the ``engine_resumed`` event an agent sends as it starts."""

_EXCERPT_BYTES = 120
_AGENT_EVENTS = frozenset(
    {
        "command_handled",
        "bad_message",
        "command_refused",
        "lease_expired",
        "reconciled",
        "engine_resumed",
    }
)
_COORDINATOR_EVENTS = frozenset(
    {
        "update_started",
        "phase_finished",
        "update_finished",
        "bad_message",
        "leader_elected",
        "worker_conflict",
        "committed_reset",
        "member_alert",
        "request_refused",
    }
)
_BROADCAST_ONLY = frozenset({"committed", "renew_lease"})
"""Commands the coordinator sends to every agent at once."""
_ONE_WORKER_ONLY = frozenset({"refuse_instance"})
"""Commands the coordinator sends on each worker's own subject, never broadcast."""


class TrailRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One captured message: its stream sequence and subject, and the message."""

    seq: int
    subject: str
    ts: float
    """When the stream stored it (Unix time)."""
    kind: str
    """``command``, ``ack`` or ``event``, as its subject says (``unknown``: none)."""
    message: dict[str, Any]
    """The message as lorabus reads it (fields it does not know are dropped);
    empty for a poison record."""
    poison: str = ""
    """Why the payload is no valid message for its subject, with its size and
    an escaped excerpt; empty for a good record."""


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    rule: str
    message: str
    seqs: list[int]
    """Stream sequences of the records that show it."""


class Origin(msgspec.Struct, frozen=True, kw_only=True):
    """What a record's subject says of it: the only part of it the server vouches for."""

    kind: str
    """``command``, ``ack``, ``event``, or ``unknown`` for no audited subject."""
    worker: str | None = None
    """The worker the subject names (an ack's or agent event's sender, a command's addressee)."""
    sender: str = ""
    """``coordinator`` or ``agent``, for events."""
    event_kind: str | None = None
    """The event type the subject names."""


_READERS: dict[str, Reader[Any]] = {
    "command": command_decoder,
    "ack": ack_message_decoder,
    "event": event_decoder,
}


def origin_of(subject: str, prefix: str = DEFAULT_PREFIX) -> Origin:
    """Parse ``<prefix>.<fleet>.cmd[.<w>]``, ``...ack.<w>``,
    ``...evt.coordinator.<kind>`` and ``...evt.agent.<w>.<kind>``."""
    head = prefix + "."
    if not subject.startswith(head):
        return Origin(kind="unknown")
    tokens = subject[len(head) :].split(".")[1:]  # past the fleet
    match tokens:
        case ["cmd"]:
            return Origin(kind="command")
        case ["cmd", worker]:
            return Origin(kind="command", worker=worker)
        case ["ack", worker]:
            return Origin(kind="ack", worker=worker)
        case ["evt", "coordinator", kind]:
            return Origin(kind="event", sender="coordinator", event_kind=kind)
        case ["evt", "agent", worker, kind]:
            return Origin(kind="event", sender="agent", worker=worker, event_kind=kind)
    return Origin(kind="unknown")


def read_payload(origin: Origin, data: bytes) -> Any:
    """The message of a payload, read as its subject's family; raises only BadPayload."""
    reader = _READERS.get(origin.kind)
    if reader is None:
        raise BadPayload("not an audited subject")
    return reader.decode(data)


def poison_text(error: BaseException | str, data: bytes) -> str:
    """Why a payload was refused, its size and the start of it, escaped."""
    excerpt = repr(bytes(data[:_EXCERPT_BYTES]))
    more = "..." if len(data) > _EXCERPT_BYTES else ""
    return printable(f"{error}; {len(data)} bytes: {excerpt}{more}")[:1024]


def workers_records(
    record: TrailRecord, nodes: NodeRoster | None = None, prefix: str = DEFAULT_PREFIX
) -> list[TrailRecord]:
    """A node's acks record as one record per worker's ack (each as that
    worker's own would be), leaving out those ``nodes`` (the roster, when
    there is one) does not let the node give, and all of a record whose body
    claims another node than its subject; nothing of an agent's ack or event
    whose body claims another worker than its subject; any other record as
    itself."""
    message = record.message
    if record.poison or record.kind not in ("ack", "event"):
        return [record]
    # The sender is the one its subject names (the server's permissions prove
    # that), not the one its body claims.
    origin = origin_of(record.subject, prefix)
    sender = origin.worker or ""
    if origin.kind == "event" and origin.sender == "agent":
        return [record] if message.get("worker_id", sender) == sender else []
    if origin.kind != "ack":
        return [record]
    if message.get("type") != "node_acks":
        return [record] if message.get("worker_id") == sender else []
    listed = message.get("acks")  # a trail file may have been edited: any shape
    if message.get("node") != sender or not isinstance(listed, list):
        return []
    acks = [ack for ack in listed if isinstance(ack, dict)]
    if nodes is not None:
        acks = [ack for ack in acks if nodes.refusal(sender, str(ack.get("worker_id"))) is None]
    return [msgspec.structs.replace(record, message=ack) for ack in acks]


def decode_message(record: TrailRecord, prefix: str = DEFAULT_PREFIX) -> Any:
    """The typed message of a record, read again (a file may have been edited);
    raises only BadPayload."""
    if record.poison:
        raise BadPayload(record.poison)
    try:
        data = msgspec.json.encode(record.message)
    except (msgspec.EncodeError, RecursionError) as exc:
        raise BadPayload(f"cannot be encoded again: {exc}") from None
    return read_payload(origin_of(record.subject, prefix), data)


def subject_problem(origin: Origin, message: Any, nodes: NodeRoster | None = None) -> str:
    """How ``message`` disagrees with the subject it came on ("" when it
    agrees); ``nodes``: which workers each node may ack for (None: any)."""
    tag = tag_of(message)
    claimed_worker = getattr(message, "worker_id", None)
    match origin.kind:
        case "ack" if isinstance(message, NodeAcks):
            if message.node != origin.worker:
                return f"a node's acks on the subject of {origin.worker!r} claim {message.node!r}"
            if nodes is not None:
                refusals = (nodes.refusal(message.node, a.worker_id) for a in message.acks)
                refusal = next((r for r in refusals if r), None)
                if refusal is not None:
                    return refusal
        case "ack":
            if claimed_worker != origin.worker:
                return f"an ack on the subject of {origin.worker!r} claims {claimed_worker!r}"
        case "event" if origin.sender == "coordinator":
            if tag not in _COORDINATOR_EVENTS:
                return f"a {tag} event is no coordinator's"
            if message.source != "coordinator":
                return f"a coordinator event claims the source {message.source!r}"
            if tag != origin.event_kind:
                return f"a {tag} event on the subject of {origin.event_kind!r} events"
        case "event":
            if tag not in _AGENT_EVENTS:
                return f"a {tag} event on the subject of agent {origin.worker!r} is no agent's"
            if message.source != f"agent:{origin.worker}":
                return (
                    f"an event on the subject of agent {origin.worker!r} claims "
                    f"the source {message.source!r}"
                )
            if claimed_worker is not None and claimed_worker != origin.worker:
                return (
                    f"an event on the subject of agent {origin.worker!r} claims "
                    f"the worker {claimed_worker!r}"
                )
            if tag != origin.event_kind:
                return f"a {tag} event on the subject of {origin.event_kind!r} events"
        case "command" if origin.worker is None:
            if tag in _ONE_WORKER_ONLY:
                return f"a {tag} command broadcast to the whole fleet"
            if tag == "pause" and (not message.cohort or message.targets):
                # The coordinator broadcasts a pause only to open a cohort; a
                # pause naming workers goes on each one's own subject.
                return f"a pause broadcast naming {message.targets!r}, opening no cohort"
        case "command":
            if tag in _BROADCAST_ONLY:
                return f"a {tag} command on the subject of worker {origin.worker!r} alone"
            if origin.worker not in message.targets:
                return (
                    f"a {tag} command on the subject of worker {origin.worker!r} "
                    f"addressed to {message.targets!r}"
                )
    return ""


def verify(
    records: Iterable[TrailRecord],
    *,
    prefix: str = DEFAULT_PREFIX,
    nodes: NodeRoster | None = None,
) -> list[Violation]:
    """The promises ``records`` break; ``nodes``: which workers each node
    may ack for (by default ``$LORABUS_NODES_FILE``'s, else any)."""
    nodes = nodes if nodes is not None else NodeRoster.from_env()
    checker = _Checker()
    for record in sorted(records, key=lambda r: r.seq):
        origin = origin_of(record.subject, prefix)
        where = f"record {record.seq} on {record.subject!r}"
        if origin.kind == "unknown" and not record.poison:
            checker.violate("subject_mismatch", f"{where}: no audited subject", [record.seq])
            continue
        try:
            message = decode_message(record, prefix)
        except BadPayload as exc:
            checker.violate("poison_record", f"{where}: {exc}", [record.seq])
            continue
        problem = subject_problem(origin, message, nodes)
        if problem:
            # Not replayed: what it claims is not what its sender may say.
            checker.violate("subject_mismatch", f"{where}: {problem}", [record.seq])
            continue
        checker.feed(record.seq, message)
    return checker.finish()


class _AgentRun(msgspec.Struct, kw_only=True):
    """One agent process of a worker, as far as the trail shows it."""

    instance: str = ""
    """Its instance id, once an ack names it."""
    highest: int = 0
    """The highest epoch it acted on or saw."""
    shown_at: int = 0
    """The sequence of the record that shows ``highest``."""


class _Checker:
    def __init__(self) -> None:
        self.violations: list[Violation] = []
        self.open_pauses: dict[tuple[str, str], int] = {}
        """(worker, update) -> seq of the ok pause ack not yet undone."""
        self.load_acks: dict[tuple[str, str], int] = {}
        self.runs: dict[str, _AgentRun] = {}
        """worker -> its current agent process."""
        self.started: dict[str, tuple[UpdateStarted, int]] = {}
        self.commits: dict[str, tuple[RankMap, str, int]] = {}
        """served name -> (rank map, update id, seq) of its latest commit in the trail."""

    def violate(self, rule: str, message: str, seqs: list[int]) -> None:
        self.violations.append(Violation(rule=rule, message=message, seqs=seqs))

    def feed(self, seq: int, message: Any) -> None:
        match message:
            case Ack():
                self._ack(seq, message)
            case NodeAcks():
                for ack in message.acks:
                    self._ack(seq, ack)
            case UpdateStarted():
                self.started[message.update_id] = (message, seq)
            case UpdateFinished():
                self._finished(seq, message)
            case LeaseExpired(resumed=True):
                self.open_pauses.pop((message.worker_id, message.update_id), None)
            case EngineResumed():
                for key in [k for k in self.open_pauses if k[0] == message.worker_id]:
                    del self.open_pauses[key]
                if message.reason == AGENT_START:
                    # A new process: it knows the epoch it read at start, no more.
                    self.runs[message.worker_id] = _AgentRun(highest=message.epoch, shown_at=seq)
            case CommandRefused():
                self._saw_epoch(self._run_of(message.worker_id), message.epoch_seen, seq)

    def _run_of(self, worker: str, instance: str = "") -> _AgentRun:
        run = self.runs.get(worker)
        if run is None or (instance and run.instance and run.instance != instance):
            # A process the trail shows no start of (its start event was lost,
            # or precedes the trail): judged from its own acks on.
            run = self.runs[worker] = _AgentRun()
        if instance and not run.instance:
            run.instance = instance
        return run

    def _ack(self, seq: int, message: Ack) -> None:
        for ack in acks_in(message):
            self._one_ack(seq, ack)

    def _one_ack(self, seq: int, ack: Ack) -> None:
        if ack.ok:
            run = self._run_of(ack.worker_id, ack.instance)
            if ack.epoch < run.highest:
                self.violate(
                    "stale_epoch_acted",
                    f"{ack.worker_id} acted on {ack.phase} of update {ack.update_id} "
                    f"at epoch {ack.epoch} after seeing epoch {run.highest}",
                    [run.shown_at, seq],
                )
            self._saw_epoch(run, ack.epoch, seq)
        key = (ack.worker_id, ack.update_id)
        match ack.phase:
            case Phase.PAUSE if ack.ok:
                self.open_pauses.setdefault(key, seq)
            case Phase.RESUME if ack.ok and ack.paused:
                # Held: another update of its round still holds the engine
                # paused (a shared pause); only this update's pause ends.
                self.open_pauses.pop(key, None)
            case Phase.RESUME if ack.ok:
                # A resume of any update un-pauses the engine.
                for open_key in [k for k in self.open_pauses if k[0] == ack.worker_id]:
                    del self.open_pauses[open_key]
            case Phase.LOAD if ack.ok:
                self.load_acks[key] = seq

    @staticmethod
    def _saw_epoch(run: _AgentRun, epoch: int, seq: int) -> None:
        if epoch > run.highest:
            run.highest, run.shown_at = epoch, seq

    def _finished(self, seq: int, finished: UpdateFinished) -> None:
        started = self.started.pop(finished.update_id, None)
        if finished.status != COMMITTED or finished.rank_map is None:
            return
        if started is None:
            self._answered_from_record(seq, finished, finished.rank_map)
            return
        rank_map = finished.rank_map
        self.commits[finished.adapter] = (rank_map, finished.update_id, seq)
        for entry in rank_map.entries:
            if (entry.worker_id, finished.update_id) not in self.load_acks:
                self.violate(
                    "load_not_acked",
                    f"update {finished.update_id} committed with "
                    f"{entry.worker_id}, which never acked its load",
                    [seq],
                )
        problem = _rank_map_problem(rank_map, started[0])
        if problem:
            self.violate(
                "rank_map_mismatch", f"update {finished.update_id}: {problem}", [started[1], seq]
            )

    def _answered_from_record(self, seq: int, finished: UpdateFinished, rank_map: RankMap) -> None:
        """A commit with no start in the trail: an update answered "already
        committed" (no phase ran, so no load acks), or one whose start precedes
        the trail. Either way it must repeat the latest commit of its name."""
        earlier = self.commits.get(finished.adapter)
        if earlier is not None and earlier[0] != rank_map:
            self.violate(
                "rank_map_mismatch",
                f"update {finished.update_id} answered {finished.adapter!r} committed with "
                f"a rank map other than that of update {earlier[1]}",
                [earlier[2], seq],
            )
            return
        problem = _rank_map_problem(rank_map, None)
        if problem:
            self.violate("rank_map_mismatch", f"update {finished.update_id}: {problem}", [seq])

    def finish(self) -> list[Violation]:
        for (worker, update_id), seq in sorted(self.open_pauses.items(), key=lambda i: i[1]):
            self.violate(
                "unresumed_pause",
                f"{worker} paused for update {update_id} and was never resumed",
                [seq],
            )
        for update_id, (_, seq) in sorted(self.started.items(), key=lambda i: i[1][1]):
            self.violate(
                "no_terminal_result", f"update {update_id} started and never finished", [seq]
            )
        return self.violations


def _rank_map_problem(rank_map: RankMap, started: UpdateStarted | None) -> str:
    ids = [entry.worker_id for entry in rank_map.entries]
    if ids != sorted(ids):
        return f"workers are not in worker-id order: {ids}"
    expected_offset = 1
    for entry in rank_map.entries:
        if entry.rank_offset != expected_offset:
            return (
                f"{entry.worker_id} has rank offset {entry.rank_offset}, expected {expected_offset}"
            )
        if started is not None and started.members.get(entry.worker_id) != entry.world_size:
            return (
                f"{entry.worker_id} has world size {entry.world_size} in the rank map but "
                f"{started.members.get(entry.worker_id)} in the membership"
            )
        expected_offset += entry.world_size
    if rank_map.world_size != expected_offset:
        return f"group world size {rank_map.world_size}, expected {expected_offset}"
    return ""
