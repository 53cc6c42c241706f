"""The rank map of the trainer -> inference weight-broadcast group (NCCL/NIXL).

The trainer is rank 0. Workers are ordered by worker id in plain string order
(``sorted()`` on ``str``: "w10" sorts before "w2"), never by arrival or list
order, so every process that builds the map from the same membership gets the
same ranks. Each worker owns ``world_size`` consecutive ranks starting at its
``rank_offset``; tensor-parallel sizes may differ between workers.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from typing import Annotated

import msgspec

from lorabus.schemas.bounds import WorkerId, WorldSize


class WorkerRole(enum.StrEnum):
    """What a worker does in serving: both phases, or one of disaggregated
    serving's (Dynamo's prefill and decode workers each load the adapter)."""

    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


Role = Annotated[str, msgspec.Meta(pattern=r"^[a-z][a-z_-]{0,31}$")]
"""A role on the wire: one of ``WorkerRole`` today, any such word tomorrow
(an older peer keeps a role it does not know as text, not as an error)."""

DataParallel = Annotated[int, msgspec.Meta(ge=1, le=1024)]
"""Data-parallel ranks behind one engine server (vLLM ``--data-parallel-size``)."""


class RankEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One worker's ranks. Its ``role`` and ``data_parallel`` are sent only
    when not their defaults: a rank map lists every member, and stays the
    size it was for a fleet of aggregated single-rank workers."""

    worker_id: WorkerId
    world_size: WorldSize
    rank_offset: int
    role: Role = WorkerRole.AGGREGATED.value
    data_parallel: DataParallel = 1
    """Its engine's data-parallel ranks: its ``world_size`` ranks are
    ``data_parallel`` groups of ``world_size // data_parallel`` consecutive
    ranks, one per data-parallel rank, in order."""


class RankMap(msgspec.Struct, frozen=True, kw_only=True):
    world_size: int
    """Size of the whole group: 1 (the trainer) + every worker's world size."""
    entries: list[RankEntry]
    membership_version: str
    """A digest of the membership: when it changes, the group must be rebuilt."""

    def offset_of(self, worker_id: str) -> int | None:
        for entry in self.entries:
            if entry.worker_id == worker_id:
                return entry.rank_offset
        return None


def build_rank_map(
    world_sizes: Mapping[str, int], layouts: Mapping[str, tuple[str, int]] | None = None
) -> RankMap:
    """Build the rank map of a membership given as ``{worker_id: world_size}``;
    ``layouts``: each worker's role and data-parallel ranks, where not the
    default (aggregated, 1)."""
    entries: list[RankEntry] = []
    next_rank = 1
    digest = hashlib.sha256()
    for worker_id in sorted(world_sizes):
        size = world_sizes[worker_id]
        if size < 1:
            raise ValueError(f"worker {worker_id!r} has world size {size}; it must be >= 1")
        role, ranks = (layouts or {}).get(worker_id, (WorkerRole.AGGREGATED.value, 1))
        entries.append(
            RankEntry(
                worker_id=worker_id,
                world_size=size,
                rank_offset=next_rank,
                role=role,
                data_parallel=ranks,
            )
        )
        digest.update(f"{worker_id}={size};".encode())
        if (role, ranks) != (WorkerRole.AGGREGATED, 1):
            # Another layout of the same ranks is another group to build.
            digest.update(f"{worker_id}:{role}/{ranks};".encode())
        next_rank += size
    return RankMap(
        world_size=next_rank, entries=entries, membership_version=digest.hexdigest()[:16]
    )
