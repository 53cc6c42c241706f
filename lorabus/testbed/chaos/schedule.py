"""The fault schedule of a chaos run: which fault, where, when and for how long.

A schedule is a pure function of the seed, the run's length and the worker
ids, so a run that found a bug can be repeated with the same faults at the
same offsets (the timing of the fleet itself is not reproducible, the faults
are). The first faults cover every kind once, in a seeded order, so even a
short run injects each kind; later ones are drawn at random.

Every fault has a *target* that it occupies while it holds: one worker's agent
process, one worker's engine, or the control plane (the coordinators and the
nats-server share one target, so a coordinator is never killed while NATS is
down and the leader cannot be found). A target holds one fault at a time.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence

import msgspec


class FaultKind(enum.StrEnum):
    AGENT_KILL = "agent_kill"
    """SIGKILL of an agent process; a new one is started after ``hold_s``."""
    AGENT_STOP = "agent_stop"
    """SIGSTOP of an agent process; SIGCONT after ``hold_s``."""
    COORDINATOR_KILL = "coordinator_kill"
    """SIGKILL of the leading coordinator; a replacement standby after ``hold_s``."""
    COORDINATOR_STOP = "coordinator_stop"
    """SIGSTOP of the leading coordinator, SIGCONT after ``hold_s``: a standby takes
    over meanwhile, and the old leader wakes up still believing it leads."""
    NATS_RESTART = "nats_restart"
    """The nats-server stops; a new one on the same port and store after ``hold_s``.
    In cluster mode: one node, never the one the run observes from."""
    ENGINE_LATENCY = "engine_latency"
    """Some engine operations of one worker take ``latency_s`` longer."""
    ENGINE_ERROR = "engine_error"
    """The next ``fail_loads`` loads of one worker's engine answer an error."""
    ENGINE_HANG = "engine_hang"
    """Every request to one worker's engine waits until the fault clears."""
    ENGINE_RESTART = "engine_restart"
    """One worker's engine restarts: it loses its adapters and is not paused."""
    AGENT_PARTITION = "agent_partition"
    """One agent's link to nats-server stops forwarding (both ways, or only
    what it sends, or only what it is sent), closing nothing, for ``hold_s``:
    what it held then arrives late, in order."""
    LEADER_PARTITION = "leader_partition"
    """The leading coordinator's link, the same way: a standby takes over when
    the lease lapses, and the old leader's held messages arrive after it."""
    NATS_NODE_PARTITION = "nats_node_partition"
    """Cluster mode only: one nats-server node's routes to the others stop
    forwarding both ways for ``hold_s`` (its clients stay connected to it,
    as in a rack cut off by its switch); never the node the run observes from."""
    FROZEN_LEADER_REQUEST = "frozen_leader_request"
    """SIGSTOP of the leading coordinator, then one update asked with ONE
    ``UpdateClient.update`` call (its own update id, never retried by the run)
    while it is frozen; SIGCONT after ``hold_s``. The call must end with a
    terminal result: the client, not the run, rides out the failover."""


CLUSTER_ONLY_KINDS = frozenset({FaultKind.NATS_NODE_PARTITION})
ALL_KINDS: tuple[FaultKind, ...] = tuple(k for k in FaultKind if k not in CLUSTER_ONLY_KINDS)
"""Every kind a run on one nats-server can take."""
CLUSTER_KINDS: tuple[FaultKind, ...] = tuple(FaultKind)
"""Every kind, for a run on a nats-server cluster."""

CONTROL = "control"
"""The target of coordinator kills and stops and nats-server restarts."""
CONTROL_KINDS = frozenset(
    {
        FaultKind.COORDINATOR_KILL,
        FaultKind.COORDINATOR_STOP,
        FaultKind.NATS_RESTART,
        FaultKind.FROZEN_LEADER_REQUEST,
        FaultKind.LEADER_PARTITION,
        FaultKind.NATS_NODE_PARTITION,
    }
)
PARTITION_KINDS = frozenset({FaultKind.AGENT_PARTITION, FaultKind.LEADER_PARTITION})
_CUTS = ("both", "both", "to_bus", "from_bus")
"""How a partition cuts a link: both ways half the time."""

_HOLD_S: dict[FaultKind, tuple[float, float]] = {
    FaultKind.AGENT_KILL: (1.0, 4.0),
    FaultKind.AGENT_STOP: (0.5, 6.0),
    FaultKind.COORDINATOR_KILL: (1.0, 4.0),
    FaultKind.COORDINATOR_STOP: (1.5, 4.0),
    FaultKind.NATS_RESTART: (0.5, 3.0),
    FaultKind.ENGINE_LATENCY: (2.0, 8.0),
    FaultKind.ENGINE_ERROR: (2.0, 8.0),
    FaultKind.ENGINE_HANG: (0.5, 5.0),
    FaultKind.ENGINE_RESTART: (0.0, 0.0),
    FaultKind.FROZEN_LEADER_REQUEST: (1.5, 4.0),
    FaultKind.AGENT_PARTITION: (1.0, 8.0),
    FaultKind.LEADER_PARTITION: (1.5, 6.0),
    FaultKind.NATS_NODE_PARTITION: (1.5, 6.0),
}
_LATENCY_OPS = ("pause", "resume", "load", "unload", "list")
_IN_PAUSE_CHANCE = 0.5
_IN_PAUSE_KINDS = frozenset(
    {
        FaultKind.AGENT_KILL,
        FaultKind.AGENT_STOP,
        FaultKind.COORDINATOR_KILL,
        FaultKind.COORDINATOR_STOP,
        FaultKind.NATS_RESTART,
        FaultKind.ENGINE_HANG,
        FaultKind.ENGINE_RESTART,
        FaultKind.FROZEN_LEADER_REQUEST,
        FaultKind.AGENT_PARTITION,
        FaultKind.LEADER_PARTITION,
        FaultKind.NATS_NODE_PARTITION,
    }
)
_LATENCY_S = (0.3, 8.0)
_FAIL_LOADS = (1, 7)


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    at_s: float
    """Offset from the start of the run."""
    kind: FaultKind
    target: str
    """The worker id for agent and engine faults; ``control`` otherwise."""
    hold_s: float
    """How long the fault lasts before it is healed (0: nothing to heal)."""
    latency_s: dict[str, float] = {}
    """Engine latency faults: seconds added per operation."""
    fail_loads: int = 0
    """Engine error faults: how many loads answer an error."""
    in_pause: bool = False
    """Wait (briefly) until the target's engine, or any for control faults, is
    paused by an update, so the fault lands inside a pause window."""
    cut: str = ""
    """Partitions: ``both``, ``to_bus`` (what the process sends is held) or
    ``from_bus`` (what it is sent is held)."""

    @property
    def occupies(self) -> str:
        if self.kind in CONTROL_KINDS:
            return CONTROL
        agent_kinds = (FaultKind.AGENT_KILL, FaultKind.AGENT_STOP, FaultKind.AGENT_PARTITION)
        side = "agent" if self.kind in agent_kinds else "engine"
        return f"{side}:{self.target}"

    def describe(self) -> str:
        extra = ""
        if self.latency_s:
            extra = " " + ",".join(f"{op}+{s:.1f}s" for op, s in sorted(self.latency_s.items()))
        if self.fail_loads:
            extra = f" {self.fail_loads} loads"
        if self.cut:
            extra = f" {self.cut}"
        where = "" if self.target == CONTROL else f" {self.target}"
        hold = f" for {self.hold_s:.1f}s" if self.hold_s else ""
        when = " in a pause" if self.in_pause else ""
        return f"t+{self.at_s:.1f}s {self.kind}{where}{extra}{hold}{when}"


def build_schedule(
    seed: int,
    duration_s: float,
    worker_ids: Sequence[str],
    *,
    mean_gap_s: float = 4.0,
    warmup_s: float = 3.0,
    kinds: Sequence[FaultKind] = ALL_KINDS,
    count: int | None = None,
) -> list[Fault]:
    """The faults of a run of ``duration_s`` seconds, in order of ``at_s``.

    Faults start ``mean_gap_s`` apart on average (uniformly 0.5x-1.5x), from
    ``warmup_s`` on and no later than ``duration_s``; with ``count``, at most
    that many (``duration_s`` may then be ``math.inf``). The first faults of
    a seed are the same whatever ``duration_s`` and ``count`` are.
    """
    if not worker_ids:
        raise ValueError("a chaos schedule needs at least one worker")
    if mean_gap_s <= 0:
        raise ValueError("the mean gap between faults must be > 0")
    if count is None and duration_s == float("inf"):
        raise ValueError("an endless chaos schedule needs a count of faults")
    if not kinds or count == 0:
        return []
    rng = random.Random(seed)
    workers = sorted(worker_ids)
    pending = list(kinds)
    rng.shuffle(pending)
    busy_until: dict[str, float] = {}
    faults: list[Fault] = []
    at = warmup_s
    while at < duration_s:
        # Until every kind has been scheduled once only those kinds are, in
        # their seeded order (a kind whose targets are all busy waits).
        order = pending or [rng.choice(list(kinds)), *kinds]
        fault = _place(rng, order, round(at, 2), workers, busy_until)
        if fault is not None:
            faults.append(fault)
            busy_until[fault.occupies] = fault.at_s + fault.hold_s
            if fault.kind in pending:
                pending.remove(fault.kind)
            if count is not None and len(faults) >= count:
                break
        at += rng.uniform(0.5, 1.5) * mean_gap_s
    return faults


def _place(
    rng: random.Random,
    order: Sequence[FaultKind],
    at: float,
    workers: list[str],
    busy_until: dict[str, float],
) -> Fault | None:
    """A fault of the first kind in ``order`` that has a free target at ``at``."""
    for kind in order:
        fault = _draw(rng, kind, at, workers)
        free = [f for f in _candidates(fault, workers) if busy_until.get(f.occupies, 0.0) <= at]
        if free:
            return rng.choice(free)
    return None


def _draw(rng: random.Random, kind: FaultKind, at: float, workers: list[str]) -> Fault:
    low, high = _HOLD_S[kind]
    hold = round(rng.uniform(low, high), 2)
    latency: dict[str, float] = {}
    fail_loads = 0
    if kind is FaultKind.ENGINE_LATENCY:
        ops = rng.sample(_LATENCY_OPS, rng.randint(1, 3))
        latency = {op: round(rng.uniform(*_LATENCY_S), 2) for op in sorted(ops)}
    elif kind is FaultKind.ENGINE_ERROR:
        fail_loads = rng.randint(*_FAIL_LOADS)
    target = CONTROL if kind in CONTROL_KINDS else ""
    in_pause = kind in _IN_PAUSE_KINDS and rng.random() < _IN_PAUSE_CHANCE
    cut = rng.choice(_CUTS) if kind in PARTITION_KINDS else ""
    return Fault(
        at_s=at,
        kind=kind,
        target=target or rng.choice(workers),
        hold_s=hold,
        latency_s=latency,
        fail_loads=fail_loads,
        in_pause=in_pause,
        cut=cut,
    )


def _candidates(fault: Fault, workers: list[str]) -> list[Fault]:
    """The drawn fault, and the same fault on every other worker (for a busy target)."""
    if fault.target == CONTROL:
        return [fault]
    others = [w for w in workers if w != fault.target]
    return [fault, *(msgspec.structs.replace(fault, target=w) for w in others)]
