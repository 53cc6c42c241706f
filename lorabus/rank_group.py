"""The rank map of a committed update, joined as a ``torch.distributed`` group.

An update's result carries the rank map of the trainer -> inference
weight-broadcast group: the trainer is rank 0 and each worker owns
``world_size`` consecutive ranks from its ``rank_offset``. This module turns
that map into the group, so neither side computes ranks by hand::

    from lorabus.rank_group import join_rank_group

    # the trainer (rank 0), which also hosts the rendezvous store
    group = join_rank_group(result, "tcp://trainer:29500",
                            expected_membership_version=result.rank_map.membership_version)
    group.broadcast({"...lora_A.weight": a, "...lora_B.weight": b})

    # each of a worker's ranks, local_rank 0 .. its world_size - 1
    group = join_rank_group(rank_map, "tcp://trainer:29500", worker_id="w1", local_rank=0,
                            expected_membership_version=version)
    tensors = group.broadcast()   # the trainer's tensors, bit-exact
    group.close()

A rank refuses to join, before it touches the group, when its map is stale:
a group built from an old membership hands ranks to the wrong processes, and
torch only notices when a collective hangs or mixes weights. So
:class:`StaleMembership` is raised when the map's ``membership_version`` is not
the one the caller expects, or not the one the trainer publishes on the
rendezvous store; a worker missing from the map, or a local rank outside its
world size, is a :class:`~lorabus.errors.BadRequest`. Past those checks, ranks
of different membership versions still cannot meet: the group's keys live in
the store under a prefix named after the version.

torch is the optional extra ``lorabus[torch]``, imported only when a group is
joined, so ``import lorabus`` (and this module) never imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING

import msgspec

from lorabus.errors import BadRequest, LorabusError, StaleMembership, TorchMissing
from lorabus.schemas import RankMap, UpdateResult

if TYPE_CHECKING:
    import torch

__all__ = [
    "TRAINER_RANK",
    "RankGroup",
    "StaleMembership",
    "TorchMissing",
    "global_rank",
    "join_rank_group",
]

TRAINER_RANK = 0

#: The raw store key where the trainer publishes the membership it joins with.
_MEMBERSHIP_KEY = "lorabus/membership_version"


def _require_torch() -> None:
    """Import torch, here and not at the top, turning its absence into a clear error."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise TorchMissing(
            "the torch process group needs torch, which is not installed: "
            "pip install 'lorabus[torch]'"
        ) from exc


def _rank_map_of(source: RankMap | UpdateResult) -> RankMap:
    if isinstance(source, RankMap):
        return source
    if source.rank_map is None:
        raise BadRequest(
            f"update {source.update_id} has no rank map (status {source.status}): "
            "only a committed update defines a group"
        )
    return source.rank_map


def global_rank(rank_map: RankMap, worker_id: str | None = None, local_rank: int = 0) -> int:
    """The group rank of the trainer (``worker_id=None``) or of a worker's
    ``local_rank``-th rank: ``rank_offset + local_rank``."""
    if worker_id is None:
        if local_rank != 0:
            raise BadRequest(f"the trainer has one rank, 0; local_rank {local_rank} is not it")
        return TRAINER_RANK
    for entry in rank_map.entries:
        if entry.worker_id == worker_id:
            if not 0 <= local_rank < entry.world_size:
                raise BadRequest(
                    f"worker {worker_id!r} has world size {entry.world_size}: "
                    f"local_rank {local_rank} is not in 0..{entry.world_size - 1}"
                )
            return entry.rank_offset + local_rank
    raise BadRequest(
        f"worker {worker_id!r} is not in the rank map of membership "
        f"{rank_map.membership_version}: it is not a member of that update"
    )


def _host_port(address: str | None) -> tuple[str, int]:
    """``tcp://host:port`` or ``host:port``; None reads MASTER_ADDR and MASTER_PORT."""
    if address is None:
        host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    else:
        host, _, port = address.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")  # an IPv6 literal in brackets
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        given = address if address is not None else "MASTER_ADDR/MASTER_PORT"
        raise BadRequest(f"rendezvous address {given!r} is not tcp://host:port")
    return host, int(port)


def join_rank_group(
    source: RankMap | UpdateResult,
    address: str | None,
    *,
    expected_membership_version: str,
    worker_id: str | None = None,
    local_rank: int = 0,
    backend: str | None = None,
    timeout_s: float = 300.0,
) -> RankGroup:
    """Join this process's rank of the group that ``source``'s rank map defines.

    ``address`` is the trainer's rendezvous store (``tcp://host:port``; None:
    MASTER_ADDR and MASTER_PORT); the trainer (``worker_id=None``) hosts it.
    ``backend`` defaults to ``nccl`` when CUDA is available, else ``gloo``; for
    NCCL, select this rank's GPU (``torch.cuda.set_device``) before joining.
    ``timeout_s`` bounds the rendezvous and every collective. Raises
    :class:`StaleMembership` or :class:`~lorabus.errors.BadRequest` without
    joining, and :class:`TorchMissing` without torch.
    """
    rank_map = _rank_map_of(source)
    version = rank_map.membership_version
    if version != expected_membership_version:
        raise StaleMembership(
            f"the rank map is of membership {version}, not the expected "
            f"{expected_membership_version}: it is stale, or the expected version is"
        )
    rank = global_rank(rank_map, worker_id, local_rank)
    host, port = _host_port(address)
    _require_torch()
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        raise BadRequest("this process is already in a process group: close that group first")
    timeout = timedelta(seconds=timeout_s)
    # The store is created here, not by init_method, so the membership check
    # below happens before any rank enters the group's rendezvous.
    store = dist.TCPStore(
        host,
        port,
        world_size=rank_map.world_size,
        is_master=rank == TRAINER_RANK,
        timeout=timeout,
        wait_for_workers=False,
    )
    if rank == TRAINER_RANK:
        store.set(_MEMBERSHIP_KEY, version)
    else:
        # Waits (up to the timeout) for the trainer: it holds the newest result.
        published = store.get(_MEMBERSHIP_KEY).decode()
        if published != version:
            raise StaleMembership(
                f"the trainer at {host}:{port} joins membership {published}; this "
                f"rank map is of {version}: fetch the newest update result's rank map"
            )
    chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(
        backend=chosen,
        store=dist.PrefixStore(f"lorabus/{version}", store),
        rank=rank,
        world_size=rank_map.world_size,
        timeout=timeout,
    )
    return RankGroup(rank=rank, rank_map=rank_map, backend=chosen, store=store)


class _TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str
    shape: list[int]


_specs_decoder = msgspec.json.Decoder(list[_TensorSpec])


class RankGroup:
    """This process's rank in the weight-broadcast group; ``close()`` leaves it."""

    def __init__(self, *, rank: int, rank_map: RankMap, backend: str, store: object) -> None:
        self.rank = rank
        self.world_size = rank_map.world_size
        self.membership_version = rank_map.membership_version
        self.backend = backend
        self._store = store  # the trainer's store serves the others while the group lives
        self._open = True

    def broadcast(
        self, tensors: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Send rank 0's named tensors to every rank; every rank returns them.

        Rank 0 passes ``tensors`` (any dtypes, shapes and layouts); the others
        pass nothing. The names, dtypes and shapes go first as JSON, then every
        tensor's bytes in one buffer, so what arrives is bit-exact whatever the
        dtype (bfloat16 included) and takes one collective for the payload.
        """
        _require_torch()
        import torch
        import torch.distributed as dist

        device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        if self.rank == TRAINER_RANK:
            if tensors is None:
                raise BadRequest("rank 0 broadcasts: pass the tensors to send")
            specs = [
                _TensorSpec(name, str(t.dtype).removeprefix("torch."), list(t.shape))
                for name, t in tensors.items()
            ]
            header = torch.frombuffer(bytearray(msgspec.json.encode(specs)), dtype=torch.uint8)
            length = torch.tensor([header.numel()], dtype=torch.int64, device=device)
            dist.broadcast(length, src=TRAINER_RANK)
            dist.broadcast(header.to(device), src=TRAINER_RANK)
            parts = [t.detach().to(device).reshape(-1).view(torch.uint8) for t in tensors.values()]
            payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
            dist.broadcast(payload.to(device), src=TRAINER_RANK)
            return dict(tensors)
        if tensors is not None:
            raise BadRequest(f"rank {self.rank} receives: only rank 0 passes tensors")
        length = torch.empty(1, dtype=torch.int64, device=device)
        dist.broadcast(length, src=TRAINER_RANK)
        header = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        dist.broadcast(header, src=TRAINER_RANK)
        specs = _specs_decoder.decode(header.cpu().numpy().tobytes())
        dtypes = [_dtype(spec.dtype) for spec in specs]
        sizes = [
            _numel(spec.shape) * torch.empty(0, dtype=dtype).element_size()
            for spec, dtype in zip(specs, dtypes, strict=True)
        ]
        payload = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(payload, src=TRAINER_RANK)
        received: dict[str, torch.Tensor] = {}
        start = 0
        for spec, dtype, size in zip(specs, dtypes, sizes, strict=True):
            # clone: a slice's storage offset may not be aligned for a wider dtype.
            chunk = payload[start : start + size].clone()
            received[spec.name] = chunk.view(dtype).reshape(spec.shape)
            start += size
        return received

    def close(self, *, wait_for_all: bool = True) -> None:
        """Leave the group (``destroy_process_group``); closing twice is harmless.

        By default every rank first waits for the others (a barrier, bounded by
        the group's timeout), so rank 0 and the store it hosts outlive every
        rank's last collective. Leaving on an error skips that wait.
        """
        if not self._open:
            return
        self._open = False
        _require_torch()
        import torch.distributed as dist

        try:
            if wait_for_all and dist.is_initialized():
                dist.barrier()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            self._store = None

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # After an error the other ranks may never reach a barrier: do not wait for them.
        self.close(wait_for_all=error is None)


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise LorabusError(f"rank 0 sent a tensor of unknown dtype {name!r}")
    return dtype


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
