"""Room for one more adapter in an engine that holds a bounded number.

An engine's capacity is the most adapters it holds at once: the agent's
``--max-adapters`` (vLLM's ``--max-cpu-loras``, Dynamo's per worker), or what
the engine says of itself (SGLang's ``--max-loaded-loras``), the smaller.
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

from collections.abc import Callable

from lorabus.errors import NoCapacity


def capacity_of(configured: int, told: object) -> int | None:
    """The smaller of ``configured`` (0: none) and what the engine ``told``
    (None, or not a positive int: nothing); None when neither bounds it."""
    known = [
        c for c in (configured, told) if isinstance(c, int) and not isinstance(c, bool) and c > 0
    ]
    return min(known) if known else None


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
        raise NoCapacity(
            f"the engine of {worker_id} holds {len(held)} adapters, its capacity, and "
            f"none more it may give up for {name!r} (committed, kept, or newer than "
            f"committed): {', '.join(held)}"
        )
    return given_up[:over]
