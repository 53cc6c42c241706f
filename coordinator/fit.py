"""Results and status replies that fit the bus's message size limit.

A result and a status name every member, each with its adapter list. A fleet
of a thousand workers that each hold a few dozen adapters outgrows the
server's ``max_payload`` (1 MiB by default), or the 1 MiB every lorabus
reader accepts (``MAX_MESSAGE_BYTES``), and a message over either is never
sent or never read: the requester would ask again and again for an answer that cannot
come, and the result could not be stored. So what a reader can do without
goes first, step by step, and the message names what it left out
(``trimmed``). A result never loses its status, its rank map or the entry of
a worker that failed: without them it would say less than the truth. A
status loses each member's adapter list first, then each adapter's holders
(every adapter's commit stays), then its rank map, as each member's row
still has its offset, and last the rows of members that are ready and
running (what an operator acts on stays: members not ready, or paused).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TypeVar

import msgspec

from lorabus.schemas import MAX_MESSAGE_BYTES, FleetStatus, UpdateResult, encode
from lorabus.schemas.errors import ErrorInfo

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=msgspec.Struct)

ERROR_DETAIL_CHARS = 200
"""How much of each failed worker's error message stays when even the
entries of serving workers did not make the result fit."""


def fit_result(result: UpdateResult, max_payload: int) -> UpdateResult:
    """``result``, or the least trimmed form of it that a server of
    ``max_payload`` carries and a reader accepts (the most trimmed one,
    logged, when none does)."""
    return _first_fitting(_trimmed_results(result), max_payload, f"update {result.update_id}")


def fit_status(status: FleetStatus, max_payload: int) -> FleetStatus:
    """``status``, or the least trimmed form of it that fits, as above."""
    return _first_fitting(_trimmed_statuses(status), max_payload, "the fleet status")


def _trimmed_results(result: UpdateResult) -> Iterator[UpdateResult]:
    yield result
    workers = {
        wid: msgspec.structs.replace(outcome, adapters=[])
        for wid, outcome in result.workers.items()
    }
    yield msgspec.structs.replace(result, workers=workers, trimmed=["adapters"])
    failed = {wid: outcome for wid, outcome in workers.items() if not outcome.ok}
    yield msgspec.structs.replace(result, workers=failed, trimmed=["adapters", "serving_workers"])
    cut = {
        wid: msgspec.structs.replace(outcome, error=_cut(outcome.error))
        for wid, outcome in failed.items()
    }
    yield msgspec.structs.replace(
        result, workers=cut, trimmed=["adapters", "serving_workers", "error_detail"]
    )


def _trimmed_statuses(status: FleetStatus) -> Iterator[FleetStatus]:
    yield status
    members = [msgspec.structs.replace(m, adapters=[]) for m in status.members]
    smaller = msgspec.structs.replace(status, members=members, trimmed=["adapters"])
    yield smaller
    if any(a.holders or a.placed for a in status.adapters):
        # Each adapter still says what is committed, not which members hold
        # it or are placed to (its commit point lists those).
        adapters = [msgspec.structs.replace(a, holders=[], placed=[]) for a in status.adapters]
        smaller = msgspec.structs.replace(
            smaller, adapters=adapters, trimmed=[*smaller.trimmed, "holders"]
        )
        yield smaller
    smaller = msgspec.structs.replace(
        smaller, acked=[], waiting=[], trimmed=[*smaller.trimmed, "phase_members"]
    )
    yield smaller
    # Each member's row carries its rank offset: the map says it twice.
    smaller = msgspec.structs.replace(
        smaller, rank_map=None, trimmed=[*smaller.trimmed, "rank_map"]
    )
    yield smaller
    # Tens of thousands of members: keep those an operator must look at;
    # live_world_size still counts every one.
    unwell = [m for m in smaller.members if not m.ready or m.paused]
    yield msgspec.structs.replace(
        smaller, members=unwell, trimmed=[*smaller.trimmed, "ready_members"]
    )


def _cut(error: ErrorInfo | None) -> ErrorInfo | None:
    if error is None or len(error.message) <= ERROR_DETAIL_CHARS:
        return error
    return msgspec.structs.replace(error, message=error.message[:ERROR_DETAIL_CHARS] + "...")


def _first_fitting(forms: Iterator[_M], max_payload: int, what: str) -> _M:
    limit = min(max_payload, MAX_MESSAGE_BYTES)
    form = next(forms)
    for smaller in forms:
        if len(encode(form)) <= limit:
            return form
        form = smaller
    size = len(encode(form))
    if size > limit:
        log.error(
            "%s is %d bytes even trimmed, over the limit of %d bytes "
            "(the server's max_payload, at most lorabus's 1 MiB): it cannot be sent",
            what,
            size,
            limit,
        )
    return form
