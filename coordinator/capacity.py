"""Whether an update fits in its members' engines.

An engine holds a bounded number of adapters (vLLM's ``--max-cpu-loras``,
SGLang's ``--max-loaded-loras``); past it, it evicts on its own, and
requests for the evicted one are refused or loaded again on the request
path. Each agent says its engine's capacity in its heartbeat. While an
update runs, its members serve everything the fleet has committed there
(every adapter's committed version and the versions kept beside it, on the
workers it is placed on: ``placement.py``) and the new version beside it:
the commit's retire step unloads the adapter's oldest only after it
commits. An update whose members cannot hold that many fails
at once, ``no_capacity``, before anything is paused or loaded, naming them
and what they hold. Within capacity, an agent makes room for a load by
unloading the oldest versions nothing keeps (``agents/executor.py``), so a
leftover never pushes a committed version out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lorabus.coordinator.placement import Served, needed_on
from lorabus.schemas import ErrorCode, ErrorInfo, Heartbeat

_NAMED = 8
"""Members, and adapters of each, that a refusal spells out; the rest are counted."""


def no_room(
    own: Sequence[str], beside: Sequence[Served], members: Mapping[str, Heartbeat]
) -> ErrorInfo | None:
    """Why members cannot hold ``own`` (an update's new served name first,
    then the versions of its adapter they will keep) beside ``beside``,
    or None. It
    counts what they hold, and names none of it: the answer goes to the
    requester, who may be a tenant, and the names are other tenants'
    (``lorabus status`` shows an operator each member's list)."""
    served_name = own[0]
    # Only members that say what they hold at most: counting every member's
    # names cost N x (T adapters x versions) per update whatever the engines.
    bounded = {worker: beat for worker, beat in members.items() if beat.capacity is not None}
    needs = {worker: len(needed_on(worker, own, beside)) for worker in bounded}
    short = sorted(
        (worker, beat)
        for worker, beat in bounded.items()
        if beat.capacity is not None and needs[worker] > beat.capacity
    )
    if not short:
        return None
    most = max(needs[worker] for worker, _ in short)
    named = [
        f"{worker} (capacity {beat.capacity}; holds {len(beat.adapters)})"
        for worker, beat in short[:_NAMED]
    ]
    if len(short) > _NAMED:
        named.append(f"and {len(short) - _NAMED} more")
    return ErrorInfo(
        code=ErrorCode.NO_CAPACITY,
        message=f"{served_name} needs room for up to {most} adapters at once "
        "(the committed and kept versions of every adapter placed there, and it) on members "
        "that hold fewer: "
        + "; ".join(named)
        + ". Keep fewer versions (--keep), retire adapters, or give the engines room",
    )
