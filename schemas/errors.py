"""Error codes, and errors as they cross the bus.

Errors travel as data (:class:`ErrorInfo`: a stable ``code`` and a readable
``message``), never as tracebacks. Inside a process they are raised as the
exceptions of :mod:`lorabus.errors`, each of which carries one of these codes.
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
    BUSY = "busy"
    """The coordinator's queue of waiting requests is full; ask again later."""
    PATH_REFUSED = "path_refused"
    """An agent refused the adapter path: outside its adapter roots after
    resolving symlinks, not a directory, or without an adapter config."""
    DIGEST_MISMATCH = "digest_mismatch"
    """Members see other bytes at the adapter path than the request's digest, or
    than each other: a stale or half-synced shared filesystem."""
    FETCH_FAILED = "fetch_failed"
    """An agent could not fetch the adapter from the fleet's object store."""
    DUPLICATE_WORKER = "duplicate_worker"
    """Another live agent already holds this worker id."""
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
    NOT_PAUSED = "not_paused"
    """A load meant for an engine this update's pause paused cannot run: the
    agent has not taken that pause, it failed or ran out, or the update's
    resume came first."""
    NOT_LISTED = "not_listed"
    """The engine said it loaded the adapter, but its own list does not show it."""
    CANARY_FAILED = "canary_failed"
    """A generation with the new served name was not answered as that name: on
    a member's own engine (the message names the worker and the engine's
    answer) or through the frontend."""
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
    BUS_UNREACHABLE = "bus_unreachable"
    """The requester could not connect to NATS (raised in its own process)."""
    NO_CAPACITY = "no_capacity"
    """Some members' engines cannot hold what the fleet serves and the new
    version beside it (their ``capacity``); the message names them and what
    they hold. Nothing was paused or loaded."""
    FORBIDDEN = "forbidden"
    """A tenant asked for an adapter, or named an update id, that is not its
    own (``coordinator/tenants.py``): refused, and nothing was kept."""
    QUOTA = "quota"
    """A tenant's quota would be exceeded: its adapters, or the versions it
    asked to keep. Nothing was kept; a full queue is ``busy``."""
    PERMISSION_DENIED = "permission_denied"
    """NATS refused the credentials, a publish or a subscribe (raised in the
    process whose connection was refused)."""


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True):
    code: ErrorCode
    message: str
