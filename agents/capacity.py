"""Room for one more adapter in an engine that holds a bounded number.

An engine's capacity is the most adapters it holds at once: the agent's
``--max-adapters`` (vLLM's ``--max-cpu-loras``, Dynamo's per worker), or
what the engine says of itself (SGLang's ``--max-loaded-loras``), the
smaller. (vLLM past its figure still serves, reading an adapter again from
its path at request time, and its default is 1: it bounds only when told.)
Past it an engine evicts on its own (SGLang unloads the least recently used,
which may be the committed version) or refuses. So before a load at
capacity the agent unloads the oldest versions nothing keeps (old versions
of a committed adapter, neither committed nor kept: ``DesiredState.stale``),
and refuses the load, ``no_capacity``, when that is not enough: a committed
or kept version is never given up for it. The coordinator refuses beforehand
an update that cannot fit (``coordinator/capacity.py``); this holds the line
when updates of several adapters load at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from lorabus.errors import NoCapacity
from lorabus.schemas.bounds import MAX_NAMES

log = logging.getLogger(__name__)


def capacity_of(configured: int, told: object) -> int | None:
    """The smaller of ``configured`` (0: none) and what the engine ``told``
    (None, or not a positive int: nothing); None when neither bounds it."""
    known = [
        c for c in (configured, told) if isinstance(c, int) and not isinstance(c, bool) and c > 0
    ]
    return min(*known, MAX_NAMES) if known else None


def room_for(
    name: str,
    held: list[str],
    capacity: int | None,
    spare: Callable[[list[str]], list[str]],
    worker_id: str,
) -> list[str]:
    """What to unload before loading ``name`` into an engine that holds
    ``held``; NoCapacity when it cannot be made room for."""
    if capacity is None or name in held:
        return []
    over = len(held) + 1 - capacity
    if over <= 0:
        return []
    given_up = spare(held)
    if len(given_up) < over:
        # Counted, not named: the ack's error reaches the requester, and the
        # names may be other tenants' (the agent's heartbeat lists them).
        raise NoCapacity(
            f"the engine of {worker_id} holds {len(held)} adapters, its capacity, and "
            f"none more it may give up for {name!r} (committed, kept, or newer than "
            "committed)"
        )
    log.info(
        "worker=%s unloads %s to make room for %s", worker_id, ", ".join(given_up[:over]), name
    )
    return given_up[:over]


def same_adapter(one: str, other: str) -> bool:
    """Whether two served names are versions of one adapter
    (``<adapter>[-r<lineage>]-v<version>``, or the adapter's own name)."""
    return _adapter_of(one) == _adapter_of(other)


def _adapter_of(served: str) -> str:
    head, sep, tail = served.rpartition("-v")
    if not sep or not tail.isdigit():
        return served
    base, sep, lineage = head.rpartition("-r")
    return base if sep and lineage.isdigit() else head


def dropped_text(worker_id: str, name: str, dropped: list[str], held: list[str]) -> str:
    """Why a load that made the engine drop committed versions fails: those
    of the load's own adapter by name, the others counted (the error reaches
    the requester, who may be a tenant; the agent's log names them all)."""
    log.warning(
        "worker=%s loading %s dropped the committed %s; the engine lists %s",
        worker_id,
        name,
        ", ".join(dropped),
        ", ".join(held),
    )
    own = [n for n in dropped if same_adapter(n, name)]
    others = len(dropped) - len(own)
    what = ", ".join(map(repr, own)) + (" and " if own and others else "")
    what += f"{others} of other adapters" if others else ""
    return (
        f"after loading {name!r} the engine of {worker_id} no longer lists the committed "
        f"{what}, which it listed before: it drops adapters to make room (SGLang's "
        "--max-loaded-loras): let it hold the versions the fleet keeps and one more; it "
        f"lists {len(held)} adapters"
    )
