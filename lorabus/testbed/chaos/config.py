"""What a chaos run does, in one place: the run's settings and its fleet's.

Importable without the ``sim`` extra, so that the CLI shows these defaults
in ``lorabus chaos --help`` whether or not the extra is installed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lorabus.client import REASK_S
from lorabus.testbed.chaos.schedule import ALL_KINDS, CLUSTER_KINDS, FaultKind
from lorabus.testbed.chaos.timeline import DEFAULT_ADAPTER
from lorabus.testbed.chaos.verdict import Bounds

MAX_TENANTS = 16
"""As many as the coordinator runs updates of different adapters at once
(``--max-concurrent``'s default)."""


@dataclass(frozen=True)
class FleetSettings:
    world_sizes: Sequence[int]
    fleet: str = "chaos"
    heartbeat_s: float = 0.2
    engine_timeout_s: float = 5.0
    leader_lease_s: float = 1.0
    pause_lease_s: float = 4.0
    phase_timeout_s: float = 6.0
    quorum_timeout_s: float = 5.0
    verify_timeout_s: float = 6.0
    prepare_timeout_s: float = 6.0
    """Deadline for every member to fetch an adapter from the object store."""
    quorum: float = 1.0
    keep: int = 2
    """Versions of an adapter the coordinators keep (``--keep``): beyond them a
    commit lets the oldest go, and the leader deletes its object."""
    orphan_after_s: float = 5.0
    """Objects nothing keeps go once this old (``--orphan-after``): short, so
    that deletions happen often in a run; above the client's interval
    between asks (3 s), so that a new leader has heard again of every
    request its predecessor had queued before it sweeps."""
    coordinators: int = 2
    log_level: str = "INFO"
    nats_nodes: int = 1
    """1, or 3 for a cluster (every stream and bucket then has 3 replicas)."""
    workers_per_node: int = 1
    """Above 1: the workers run under node agents (``lorabus agent
    --node-file``) of this many workers each, so an agent fault (kill, stop,
    partition) takes a whole node's workers at once."""

    def __post_init__(self) -> None:
        if self.nats_nodes not in (1, 3):
            raise ValueError(
                f"a chaos fleet runs on 1 or 3 nats-server nodes, not {self.nats_nodes}"
            )
        if not 1 <= self.workers_per_node <= 64:
            raise ValueError(f"workers per node must be 1-64, got {self.workers_per_node}")


@dataclass(frozen=True)
class ChaosConfig:
    duration_s: float = 60.0
    """Seconds of updates under faults (then every fault is healed and checked)."""
    faults: int | None = None
    """Instead of ``duration_s``: run until this many faults have been injected."""
    seed: int = 1
    """Seeds the fault schedule: the same seed, the same faults."""
    world_sizes: Sequence[int] = (2, 1, 4, 1)
    """One per worker."""
    fleet: FleetSettings | None = None
    """Process settings; default: the short ones, for these world sizes."""
    mean_gap_s: float = 4.0
    """Mean time between the starts of two faults."""
    kinds: Sequence[FaultKind] | None = None
    """Default: every kind the fleet can take (node partitions need a cluster)."""
    grace_s: float | None = None
    """Added to the pause lease; default: a phase timeout + 2 s."""
    converge_s: float = 10.0
    attempt_timeout_s: float = 8.0
    retry_bound_s: float = 90.0
    idle_chance: float = 0.1
    """Share of gaps between updates that last longer than lease + grace."""
    run_dir: Path | None = None
    """Logs, NATS store and adapters; default: a temporary one, kept on violations."""
    adapters: Literal["bus", "path"] = "bus"
    """How updates name adapters: ``bus``, pushed to the fleet's object store
    and asked for by digest (each agent fetches it into a cache of its own);
    ``path``, a directory every agent reads."""
    reuse_chance: float = 0.15
    """Share of steps (``bus``) that push an earlier step's or orphan's bytes
    again as their new version: the same digest, maybe deleted since."""
    orphan_chance: float = 0.15
    """Share of steps (``bus``) that also push an adapter never asked for."""
    store_sample_s: float = 0.5
    """How often (``bus``) the store is sampled against its records (``store_keeps``)."""
    tenants: int = 1
    """Trainers updating at once, each its own loop on its own adapter
    (``tenant-0``, ``tenant-1``, ...; with one, ``policy``)."""

    def __post_init__(self) -> None:
        if self.adapters not in ("bus", "path"):
            raise ValueError(f"adapters travel by 'bus' or 'path', not {self.adapters!r}")
        for name in ("reuse_chance", "orphan_chance"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.store_sample_s <= 0:
            raise ValueError(f"store_sample_s must be > 0, got {self.store_sample_s}")
        if not 1 <= self.tenants <= MAX_TENANTS:
            raise ValueError(f"tenants must be in [1, {MAX_TENANTS}], got {self.tenants}")

    @property
    def by_bus(self) -> bool:
        return self.adapters == "bus"

    def adapter_names(self) -> list[str]:
        """Each tenant's adapter, in tenant order."""
        if self.tenants == 1:
            return [DEFAULT_ADAPTER]
        return [f"tenant-{i}" for i in range(self.tenants)]

    def fleet_settings(self) -> FleetSettings:
        settings = self.fleet or FleetSettings(world_sizes=self.world_sizes)
        return dataclasses.replace(settings, world_sizes=tuple(self.world_sizes))

    def fault_kinds(self) -> Sequence[FaultKind]:
        if self.kinds is not None:
            return self.kinds
        return CLUSTER_KINDS if self.fleet_settings().nats_nodes > 1 else ALL_KINDS

    def one_call_timeout_s(self) -> float:
        """The timeout of the one call a frozen-leader request makes: the leader
        lease (until a standby takes over), the client's interval between asks
        (until it asks the new leader) and 2 s to spare, then the successor's
        roll-back of what the frozen leader left in flight (a resume: one phase)
        and two whole updates at their deadlines (with their fetches from the
        store, by bus): at most one queued ahead of it (the update loop asks
        one at a time), and its own."""
        s = self.fleet_settings()
        update_s = s.quorum_timeout_s + 3 * s.phase_timeout_s + s.verify_timeout_s
        if self.by_bus:
            update_s += s.prepare_timeout_s
        return s.leader_lease_s + REASK_S + 2.0 + s.phase_timeout_s + 2 * update_s

    def bounds(self) -> Bounds:
        s = self.fleet_settings()
        grace = s.phase_timeout_s + 2.0 if self.grace_s is None else self.grace_s
        return Bounds(
            pause_lease_s=s.pause_lease_s,
            grace_s=grace,
            converge_s=self.converge_s,
            quorum_all=s.quorum == 1.0,
        )
