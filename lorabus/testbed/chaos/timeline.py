"""What a chaos run saw, on one clock: the record the invariants are judged on.

Everything is stamped with this process's ``time.monotonic()`` when it was
seen: engine state changes of the simulated fleet (in this process, so exact),
messages on the bus (when they arrived here: among them each commit's
``committed`` notice and each heartbeat that said ready), faults (when they
were applied and healed), update requests of every tenant (when asked, sent
and answered, and of which adapter), the adapters pushed to the fleet's
object store, and samples of that store beside the records that keep its
objects. The record is plain data, so the invariant
checker is a pure function of it and can be fed planted records in tests.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from lorabus.schemas import CommandHandled, CommandRefused, UpdateResult

AGENT_DOWN = "agent_down"
"""From an agent's SIGKILL to the start of its replacement process."""
AGENT_STOPPED = "agent_stopped"
"""From an agent's SIGSTOP to its SIGCONT."""
ENGINE_HANG = "engine_hang"
ENGINE_LATENCY = "engine_latency"
ENGINE_ERROR = "engine_error"
ENGINE_RESTART = "engine_restart"
"""An instant: the engine lost its adapters and its pause."""
COORDINATOR_DOWN = "coordinator_down"
COORDINATOR_STOPPED = "coordinator_stopped"
"""Its ``worker_id`` holds the coordinator's holder name."""
NATS_DOWN = "nats_down"
AGENT_PARTITIONED = "agent_partitioned"
"""From the cut of an agent's link to nats-server to its heal (one way or both)."""
COORDINATOR_PARTITIONED = "coordinator_partitioned"
"""The same for a coordinator; its ``worker_id`` holds the holder name."""
NATS_NODE_PARTITIONED = "nats_node_partitioned"
"""One node of a cluster-mode run cut off from the other nodes; its
``worker_id`` holds the node's name."""
AGENT_CUT_OFF = "agent_cut_off"
"""An agent connected to a node while that node was cut off from the others:
what it sends reaches only that node."""

DEFAULT_ADAPTER = "policy"
"""The adapter of a run with one trainer (``--tenants 1``), and of a record
that names none."""

#: Windows during which a worker's agent cannot act on its engine at all.
BLOCKING = frozenset({AGENT_DOWN, AGENT_STOPPED, ENGINE_HANG})
#: Windows during which a worker's agent cannot hear or answer the bus: it
#: still acts on its engine (a pause lease runs out and it resumes), but it
#: cannot converge on a commit it does not hear of.
UNREACHABLE = BLOCKING | {AGENT_PARTITIONED, AGENT_CUT_OFF}


def now() -> float:
    return time.monotonic()


@dataclass
class Window:
    """A fault as it held: on one worker (``worker_id``) or the control plane ("")."""

    kind: str
    worker_id: str
    start: float
    end: float | None = None
    """None while it still holds."""
    latency_s: dict[str, float] = field(default_factory=dict)

    def overlaps(self, start: float, end: float) -> bool:
        return self.start < end and (self.end is None or self.end > start)


@dataclass
class PauseSpan:
    worker_id: str
    start: float
    end: float | None = None
    """None while the engine is still paused."""


@dataclass(frozen=True)
class LeaseCommand:
    """A pause or a lease renewal sent to a worker: its pause lease starts over."""

    worker_id: str
    at: float
    epoch: int
    update_id: str


@dataclass(frozen=True)
class SeenCommand:
    at: float
    epoch: int
    command: str
    update_id: str
    targets: frozenset[str]


@dataclass(frozen=True)
class StoreSample:
    """One look at the fleet's adapter object store, between two reads of the
    records that keep its objects (lorabus.testbed.chaos.store_watch).

    A record is named by what it is (``commit point of policy v5 ...``): the
    same name in both reads is the same record, unchanged in between."""

    began: float
    """When the first read of the records began."""
    listed_from: float
    """When the listing of the store began, after that read had ended."""
    listed_to: float
    """When the listing ended, before the second read of the records began."""
    ended: float
    """When the second read of the records ended."""
    before: dict[str, frozenset[str]]
    """Record -> the digests it keeps in the store, in the first read."""
    after: dict[str, frozenset[str]]
    """The same, in the second read."""
    stored: frozenset[str]
    """The digests of the objects the store held, as listed."""


@dataclass(frozen=True)
class Push:
    """An adapter the run pushed to the fleet's object store."""

    at: float
    digest: str
    kind: str
    """``new`` (a step's own bytes), ``again`` (an earlier step's or orphan's
    bytes, for a new version) or ``orphan`` (never requested)."""
    uploaded: bool
    """False when the store held the digest already (nothing was sent)."""


@dataclass(frozen=True)
class Notice:
    """A ``committed`` notice seen on the bus: what the fleet serves of one
    adapter once that commit is known, its version and those kept beside it."""

    at: float
    """When it was first seen (the commit point was written before it)."""
    adapter: str
    version: int
    served_name: str
    kept: frozenset[str]
    """The served names of the versions kept beside it."""
    update_id: str


@dataclass(frozen=True)
class ReadyBeat:
    """A heartbeat that said ready: what its agent process read back from its engine."""

    at: float
    instance: str
    """The agent process that sent it."""
    adapters: frozenset[str]


@dataclass
class UpdateRecord:
    update_id: str
    version: int
    path: str
    """What the request names: a directory, or ``bus:sha256:...`` (the store)."""
    requested_at: float
    adapter: str = DEFAULT_ADAPTER
    """The adapter asked for: each tenant's loop asks for its own."""
    answered_at: float | None = None
    attempts: list[str] = field(default_factory=list)
    """Per attempt: the status, or the error code of an unanswered one."""
    result: UpdateResult | None = None
    """The terminal result, if one came within the retry bound."""
    asked_again: UpdateResult | None = None
    """The answer to asking once more for the same id at the end of the run."""
    one_call_timeout_s: float | None = None
    """Set for a request made with one client call, never retried by the run
    (the frozen-leader fault): that call's timeout."""
    frozen_leader: str = ""
    """The coordinator that was frozen (SIGSTOP) when that one call was made."""
    call_s: float | None = None
    """How long that one call took to return, whatever it returned."""
    sent_at: float | None = None
    """When it was first sent (after its adapter was written, and pushed);
    None when it never was (its push did not succeed)."""

    @property
    def one_call(self) -> bool:
        return self.one_call_timeout_s is not None


@dataclass
class Timeline:
    origin: float = 0.0
    """When the run's clock started (faults' offsets count from here)."""
    world_sizes: dict[str, int] = field(default_factory=dict)
    """Every worker's true world size, as the simulated fleet was configured."""
    pauses: dict[str, list[PauseSpan]] = field(default_factory=dict)
    adapters: dict[str, list[tuple[float, frozenset[str]]]] = field(default_factory=dict)
    """Per worker: the engine's adapter set after each change."""
    windows: list[Window] = field(default_factory=list)
    lease_commands: dict[str, list[LeaseCommand]] = field(default_factory=dict)
    commands: dict[tuple[str, str, str], list[SeenCommand]] = field(default_factory=dict)
    """By (update id, command, worker): every command seen for that worker."""
    agent_starts: dict[str, list[float]] = field(default_factory=dict)
    reported_paused: dict[str, list[tuple[float, bool]]] = field(default_factory=dict)
    """Per worker: (when, paused) of every heartbeat, as its agent saw the engine."""
    epochs_seen: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """Per worker: (when, epoch) each time its reported epoch_seen went up."""
    handled: list[tuple[float, CommandHandled]] = field(default_factory=list)
    refused: list[tuple[float, CommandRefused]] = field(default_factory=list)
    leaders: list[tuple[float, str, int]] = field(default_factory=list)
    """(when, holder, epoch) of every leader_elected event."""
    updates: list[UpdateRecord] = field(default_factory=list)
    undecodable: int = 0
    event_counts: Counter[str] = field(default_factory=Counter)
    """Every event seen on the bus, by type."""
    crashes: list[str] = field(default_factory=list)
    """Processes that exited although no fault killed them (name, code, log tail)."""
    recovery_ids: set[str] = field(default_factory=set)
    """The update ids asked for after every fault was healed."""
    final_committed: str | None = None
    """The committed adapter the coordinator reported at the end, if it answered."""
    final_adapters: dict[str, str] | None = None
    """Adapter -> the served name the coordinator reported committed at the
    end, if it answered (None: not asked, or nobody answered)."""
    notices: dict[tuple[str, int], Notice] = field(default_factory=dict)
    """By (adapter, version): the first ``committed`` notice seen of it."""
    ready_beats: dict[str, list[ReadyBeat]] = field(default_factory=dict)
    """Per worker: every heartbeat that said ready."""
    instances: dict[str, float] = field(default_factory=dict)
    """Agent process instance -> when its first heartbeat was seen."""
    ended_at: float | None = None
    healed_at: float | None = None
    """When every fault had been healed (the final convergence starts here)."""
    finished_seen: dict[str, float] = field(default_factory=dict)
    """By update id: when the first ``update_finished`` event with a terminal
    status was seen for it (the coordinator had finished it by then)."""
    pushes: list[Push] = field(default_factory=list)
    store_samples: list[StoreSample] = field(default_factory=list)
    store_samples_skipped: int = 0
    """Samples of the store that could not be read whole (the bus down, a
    record unreadable): skipped, not judged."""

    def at(self, when: float) -> str:
        """``when`` as an offset into the run, as faults are printed: ``t+12.34s``."""
        return f"t{when - self.origin:+.2f}s"

    # -- the simulated engines ---------------------------------------------

    def engine_paused(self, worker_id: str, paused: bool, at: float) -> None:
        spans = self.pauses.setdefault(worker_id, [])
        open_span = spans[-1] if spans and spans[-1].end is None else None
        if paused and open_span is None:
            spans.append(PauseSpan(worker_id, at))
        elif not paused and open_span is not None:
            open_span.end = at

    def engine_adapters(self, worker_id: str, adapters: frozenset[str], at: float) -> None:
        samples = self.adapters.setdefault(worker_id, [])
        if not samples or samples[-1][1] != adapters:
            samples.append((at, adapters))

    def adapters_at(self, worker_id: str, at: float) -> frozenset[str]:
        current: frozenset[str] = frozenset()
        for when, adapters in self.adapters.get(worker_id, []):
            if when > at:
                break
            current = adapters
        return current

    def first_listed(self, worker_id: str, name: str, after: float) -> float | None:
        """The first time at or after ``after`` that the engine lists ``name``."""
        if name in self.adapters_at(worker_id, after):
            return after
        for when, adapters in self.adapters.get(worker_id, []):
            if when >= after and name in adapters:
                return when
        return None

    # -- faults ------------------------------------------------------------

    def open_window(
        self, kind: str, worker_id: str = "", at: float | None = None, **latency: float
    ) -> Window:
        window = Window(kind, worker_id, now() if at is None else at, latency_s=dict(latency))
        self.windows.append(window)
        return window

    def instant(self, kind: str, worker_id: str, at: float | None = None) -> None:
        at = now() if at is None else at
        self.windows.append(Window(kind, worker_id, at, at))

    def windows_of(self, worker_id: str, kinds: frozenset[str] | set[str]) -> list[Window]:
        return [w for w in self.windows if w.worker_id == worker_id and w.kind in kinds]

    # -- the bus -----------------------------------------------------------

    def agent_started(self, worker_id: str, at: float) -> None:
        self.agent_starts.setdefault(worker_id, []).append(at)

    def process_start(self, worker_id: str, at: float) -> float:
        """When the agent process of ``worker_id`` that was running at ``at`` started."""
        starts = [s for s in self.agent_starts.get(worker_id, []) if s <= at]
        return starts[-1] if starts else float("-inf")

    def epoch_seen(self, worker_id: str, epoch: int, at: float) -> None:
        seen = self.epochs_seen.setdefault(worker_id, [])
        since = self.process_start(worker_id, at)
        current = max((e for t, e in seen if t >= since), default=-1)
        if epoch > current:
            seen.append((at, epoch))

    def epoch_floor(self, worker_id: str, at: float) -> int:
        """The highest epoch the agent process running at ``at`` had reported by then."""
        since = self.process_start(worker_id, at)
        return max(
            (e for t, e in self.epochs_seen.get(worker_id, []) if since <= t <= at), default=0
        )

    def heartbeat(self, worker_id: str, paused: bool, at: float) -> None:
        self.reported_paused.setdefault(worker_id, []).append((at, paused))

    def readiness(
        self, worker_id: str, instance: str, ready: bool, adapters: frozenset[str], at: float
    ) -> None:
        """A heartbeat's readiness, from agent process ``instance``."""
        self.instances.setdefault(instance, at)
        if not ready:
            return
        beats = self.ready_beats.setdefault(worker_id, [])
        if beats and beats[-1].adapters == adapters:
            adapters = beats[-1].adapters  # one set for a run of equal beats
        beats.append(ReadyBeat(at, instance, adapters))

    def instance_start(self, worker_id: str, instance: str) -> float | None:
        """When agent process ``instance`` of ``worker_id`` started: the last
        start before its first heartbeat (None: never seen, or no start known)."""
        first = self.instances.get(instance)
        if first is None:
            return None
        started = self.process_start(worker_id, first)
        return None if started == float("-inf") else started

    def notice_seen(self, notice: Notice) -> None:
        self.notices.setdefault((notice.adapter, notice.version), notice)

    def adapters_of_updates(self) -> dict[str, str]:
        """Update id -> the adapter it asked for."""
        return {u.update_id: u.adapter for u in self.updates}

    def unnoticed_pauses(self, min_s: float = 1.0) -> list[tuple[str, str]]:
        """Stretches where an engine was paused while its agent kept reporting it
        running for over ``min_s``, as (worker id, what happened): the agent
        lost track of its engine's pause (a pause that landed after its agent
        gave up on it), which is what leaves an engine paused unowned."""
        found = []
        for worker_id, spans in sorted(self.pauses.items()):
            beats = self.reported_paused.get(worker_id, [])
            for span in spans:
                end = span.end if span.end is not None else (self.ended_at or math.inf)
                start = span.start + min_s
                unaware = [at for at, paused in beats if start <= at < end and not paused]
                if unaware and unaware[-1] - unaware[0] >= min_s:
                    found.append(
                        (
                            worker_id,
                            f"engine paused from {self.at(span.start)} to "
                            f"{self.at(end)}; its agent reported it running from "
                            f"{self.at(unaware[0])} to {self.at(unaware[-1])}",
                        )
                    )
        return found

    def command_seen(self, seen: SeenCommand) -> None:
        for worker_id in seen.targets:
            key = (seen.update_id, seen.command, worker_id)
            self.commands.setdefault(key, []).append(seen)

    def lease_command(self, command: LeaseCommand) -> None:
        self.lease_commands.setdefault(command.worker_id, []).append(command)

    def last_lease_command(self, worker_id: str, before: float) -> float | None:
        times = [c.at for c in self.lease_commands.get(worker_id, []) if c.at <= before]
        return max(times, default=None)

    # -- for a bug report --------------------------------------------------

    def dump(self) -> dict[str, Any]:
        """The record as plain data, times as offsets into the run (seconds)."""

        def rel(when: float | None) -> float | None:
            return None if when is None else round(when - self.origin, 3)

        return {
            "world_sizes": self.world_sizes,
            "windows": [
                {
                    "kind": w.kind,
                    "worker_id": w.worker_id,
                    "start": rel(w.start),
                    "end": rel(w.end),
                    **({"latency_s": w.latency_s} if w.latency_s else {}),
                }
                for w in self.windows
            ],
            "pauses": {
                wid: [[rel(p.start), rel(p.end)] for p in spans]
                for wid, spans in sorted(self.pauses.items())
            },
            "adapters": {
                wid: [[rel(at), sorted(names)] for at, names in samples]
                for wid, samples in sorted(self.adapters.items())
            },
            "agent_starts": {w: [rel(t) for t in ts] for w, ts in self.agent_starts.items()},
            "epochs_seen": {
                w: [[rel(t), e] for t, e in seen] for w, seen in self.epochs_seen.items()
            },
            "leaders": [[rel(at), holder, epoch] for at, holder, epoch in self.leaders],
            "refused": [[rel(at), msgspec.to_builtins(r)] for at, r in self.refused],
            "updates": [
                {
                    "update_id": u.update_id,
                    "adapter": u.adapter,
                    "version": u.version,
                    "path": u.path,
                    "requested_at": rel(u.requested_at),
                    "sent_at": rel(u.sent_at),
                    "answered_at": rel(u.answered_at),
                    "attempts": u.attempts,
                    "result": None if u.result is None else msgspec.to_builtins(u.result),
                    "asked_again": None
                    if u.asked_again is None
                    else msgspec.to_builtins(u.asked_again),
                    **(
                        {
                            "one_call_timeout_s": u.one_call_timeout_s,
                            "frozen_leader": u.frozen_leader,
                            "call_s": None if u.call_s is None else round(u.call_s, 3),
                        }
                        if u.one_call
                        else {}
                    ),
                }
                for u in self.updates
            ],
            "events": dict(self.event_counts),
            "pushes": [[rel(p.at), p.digest, p.kind, p.uploaded] for p in self.pushes],
            "store_samples": {
                "taken": len(self.store_samples),
                "skipped": self.store_samples_skipped,
                "most_objects": max((len(s.stored) for s in self.store_samples), default=0),
            },
            "healed_at": rel(self.healed_at),
            "ended_at": rel(self.ended_at),
            "final_committed": self.final_committed,
            "final_adapters": self.final_adapters,
            "notices": [
                [rel(n.at), n.adapter, n.version, n.served_name, sorted(n.kept)]
                for n in sorted(self.notices.values(), key=lambda n: n.at)
            ],
            "ready_beats": {w: len(beats) for w, beats in sorted(self.ready_beats.items())},
            "crashes": self.crashes,
        }
