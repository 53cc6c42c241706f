"""Error codes that cross the bus, and the exception tree of lorabus.

Errors travel as data (:class:`ErrorInfo`: a stable ``code`` and a readable
``message``), never as tracebacks. Inside a process they are raised as:

    LorabusError                 root of every lorabus exception
    ├── BadRequest               an update request or a flag that cannot be used
    └── EngineError              an engine answered with a failure (or not at all)
"""

from __future__ import annotations

import enum

import msgspec


class ErrorCode(enum.StrEnum):
    BAD_REQUEST = "bad_request"
    """The request cannot be run: bad name, path, version, or a malformed message."""
    STALE_VERSION = "stale_version"
    """The requested version is older than the committed one."""
    SUPERSEDED = "superseded"
    """A newer version was requested while this one waited in the queue."""
    QUORUM_TIMEOUT = "quorum_timeout"
    """Live agents' world sizes did not sum to the expected world size in time."""
    PHASE_TIMEOUT = "phase_timeout"
    """Some members did not ack a phase before its deadline."""
    WORKER_FAILED = "worker_failed"
    """Some members acked a phase with an error."""
    VERIFY_TIMEOUT = "verify_timeout"
    """The frontend did not list the adapter before the verify deadline."""
    RESUME_FAILED = "resume_failed"
    """Some member did not confirm its resume: it may still be paused."""
    ENGINE_ERROR = "engine_error"
    """An engine call failed (HTTP error, error body, transport error)."""
    NOT_LISTED = "not_listed"
    """The engine said it loaded the adapter, but its own list does not show it."""
    NO_COORDINATOR = "no_coordinator"
    """Nobody answered on the fleet's update subject."""
    TIMEOUT = "timeout"
    """The requester gave up waiting; the update may still finish."""
    FENCED = "fenced"
    """An agent refused a command from an older coordinator term."""
    FAILOVER = "failover"
    """The coordinator running the update died; its successor rolled it back."""
    NOT_LEADER = "not_leader"
    """This coordinator lost its lease while running the update."""
    INTERNAL = "internal"
    """A bug: an unexpected exception, reported instead of crashing."""


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True):
    code: ErrorCode
    message: str


class LorabusError(Exception):
    """Root of every lorabus exception."""

    code: ErrorCode = ErrorCode.INTERNAL

    def info(self) -> ErrorInfo:
        return ErrorInfo(code=self.code, message=str(self))


class BadRequest(LorabusError):
    """Raised when an update request or an option cannot be used as given."""

    code = ErrorCode.BAD_REQUEST


class EngineError(LorabusError):
    """Raised when an engine call fails; ``retryable`` says whether to try again."""

    code = ErrorCode.ENGINE_ERROR

    def __init__(self, message: str, *, retryable: bool = False, status: int | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.status = status
