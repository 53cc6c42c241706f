"""What an invariant check of a chaos run finds, and the bounds it judges by.

Shared by every check module (``pauses``, ``serving``, ``restarts``,
``results``, ``processes``, ``store_keeps``) and by the registry that runs
them all (:mod:`lorabus.testbed.chaos.invariants`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from lorabus.schemas import ErrorCode, UpdateResult

UNANSWERED = frozenset({ErrorCode.TIMEOUT, ErrorCode.NO_COORDINATOR, ErrorCode.NOT_LEADER})
"""Failed results that only say the requester heard nothing final: ask again."""


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    invariant: str
    subject: str
    """The worker id or update id it is about."""
    detail: str
    adapter: str = ""
    """The adapter (or adapters, comma-separated) it concerns; "" for none in
    particular (a process, the store)."""

    def __str__(self) -> str:
        about = f" ({self.adapter})" if self.adapter else ""
        return f"VIOLATION {self.invariant} [{self.subject}]{about}: {self.detail}"


@dataclass(frozen=True)
class Bounds:
    pause_lease_s: float
    grace_s: float
    """Added to the pause lease: the agent may first finish the command it is
    running (up to a phase timeout) before its own resume goes out."""
    converge_s: float
    """How long an engine may take to (re)load the committed adapter."""
    quorum_all: bool = True


def is_terminal(result: UpdateResult) -> bool:
    return result.committed or result.error is None or result.error.code not in UNANSWERED
