"""An adapter's lineage, and the resets that start a new one.

A reset forgets what is committed for an adapter, so that any version may
come next; its next commit belongs to the next lineage, whose served names
(``<adapter>-r<lineage>-v<version>``) no engine can hold from before. Two
things reset: the operator's request (``lorabus reset``, run between
updates: ``admission.py`` takes the adapter's turn first), and an adapter's
commit point that does not decode, whose committed version is unknown, so
that no version can be checked against it. Both write the adapter's reset
record before they remove anything, and both are audited as
``committed_reset``.
"""

from __future__ import annotations

import logging
import time

from lorabus.coordinator.adapter_store import kept_beside
from lorabus.coordinator.signals import LeadershipLost
from lorabus.coordinator.store import CorruptRecord
from lorabus.coordinator.term import Term
from lorabus.errors import BadRequest
from lorabus.schemas import (
    CommittedRecord,
    CommittedReset,
    KeptVersion,
    ResetRecord,
    ResetRequest,
    ResetResult,
)

log = logging.getLogger(__name__)


async def lineage(term: Term, adapter: str, committed: CommittedRecord | None) -> int:
    """The lineage ``adapter``'s next commit belongs to. Without a committed
    record, the reset record decides, and an unreadable one fails the
    update: guessing lineage 0 could reuse a served name from before a reset."""
    if committed is not None:
        return committed.lineage
    known = term.book.lineages.get(adapter)
    if known is None:
        known = term.book.lineages[adapter] = await _reset_lineage(term, adapter)
    return known


async def reset_unknown(term: Term, adapter: str, corrupt: CorruptRecord) -> int:
    """Reset an adapter whose commit point does not decode: its committed
    version is unknown, so no version can be checked against it, and a
    new lineage makes every later served name new whatever comes next.
    Recorded like an operator's reset (``committed_reset``); the new lineage."""
    reason = f"the committed record of {adapter!r} does not decode: its version is unknown"
    await term.reports.corrupt(corrupt, remedy="reset to a new lineage")
    if not term.leading.is_set() or not await term.still_leading():
        raise LeadershipLost(f"epoch {term.epoch} no longer leads: nothing was reset")
    new = max(await _reset_lineage(term, adapter), term.book.lineages.get(adapter, 0)) + 1
    await _reset(term, adapter, new, None, reason)
    return new


async def reset_committed(term: Term, request: ResetRequest) -> ResetResult:
    """The operator's reset: forget what is committed for the request's
    adapter (run between updates)."""
    adapter = request.adapter
    try:
        committed = await term.committed(adapter)
    except CorruptRecord as corrupt:  # unknown version: no expected_version can match
        new = await reset_unknown(term, adapter, corrupt)
        return ResetResult(
            adapter=adapter, ok=True, lineage=new, previous_version=0, previous_path=""
        )
    if committed is None:
        raise BadRequest(f"nothing is committed for adapter {adapter!r}: nothing to reset")
    if request.expected_version is not None and request.expected_version != committed.version:
        raise BadRequest(
            f"adapter {adapter!r} has version {committed.version} committed, not "
            f"{request.expected_version}: nothing was reset"
        )
    if not term.leading.is_set() or not await term.still_leading():
        raise LeadershipLost(f"epoch {term.epoch} no longer leads: nothing was reset")
    new = max(committed.lineage, await _reset_lineage(term, adapter)) + 1
    await _reset(term, adapter, new, committed, request.reason)
    return ResetResult(
        adapter=adapter,
        ok=True,
        lineage=new,
        previous_version=committed.version,
        previous_path=committed.path,
    )


async def _reset(
    term: Term, adapter: str, new: int, committed: CommittedRecord | None, reason: str
) -> None:
    """Write the reset record and remove what was committed; audit it."""
    previous_version = committed.version if committed is not None else 0
    previous_path = committed.path if committed is not None else ""
    await term.store.reset_committed(
        ResetRecord(
            adapter=adapter,
            lineage=new,
            previous_version=previous_version,
            previous_path=previous_path,
            reason=reason,
            ts=time.time(),
            kept=_kept_by(committed),
        )
    )
    term.book.reset(adapter, new)
    if committed is not None:
        log.warning(
            "epoch=%d reset the committed state of %r (was version %d from %s), lineage %d: %s",
            term.epoch,
            adapter,
            committed.version,
            committed.path,
            new,
            reason,
        )
    await term.bus.emit(
        CommittedReset(
            ts=time.time(),
            source="coordinator",
            epoch=term.epoch,
            adapter=adapter,
            lineage=new,
            previous_version=previous_version,
            previous_path=previous_path,
            previous_served_name=committed.served_name if committed is not None else "",
            reason=reason,
        )
    )


def _kept_by(committed: CommittedRecord | None) -> list[KeptVersion]:
    """What the removed commit kept, itself first, all of it (its request may
    have asked for more than ``--keep``): a reset forgets a version, never
    the bytes (a later commit may be the same), and engines keep what they
    hold until the adapter's next commit retires it."""
    if committed is None:
        return []
    # The versions a next commit would keep beside it, with room for all.
    return kept_beside("", "", committed, None, keep=len(committed.kept) + 2)[0]


async def _reset_lineage(term: Term, adapter: str) -> int:
    """The lineage of ``adapter``'s latest reset (0: none). A reset record
    that does not decode stands for its revision plus one: every reset
    writes a record of the bucket, so no lineage yet exceeds a revision,
    and the names of a lineage past it were never served."""
    try:
        reset = await term.store.read_reset(adapter)
    except CorruptRecord as corrupt:
        await term.reports.corrupt(corrupt, remedy="taken for a lineage past its revision")
        return corrupt.revision + 1
    return reset.lineage if reset is not None else 0
