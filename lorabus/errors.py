"""Every exception lorabus raises, in one tree rooted at :class:`LorabusError`.

Errors cross the bus as data (:class:`~lorabus.schemas.ErrorInfo`: a stable
``code`` and a readable ``message``), never as tracebacks. Inside a process
they are raised as one of these, each carrying its :class:`ErrorCode`::

    LorabusError                  root; ``code`` and ``info()`` on every one
    ├── BadRequest                a request or an option that cannot be used as given
    │   ├── StaleVersion          a version older than the committed one
    │   │   └── StaleMembership   a rank map older than the one to join (lorabus.rank_group)
    │   └── TorchMissing          a rank group joined without torch installed
    ├── EngineError               an engine call failed, or the engine did not answer
    │   ├── NotListed             the engine accepted a load its own list does not show
    │   └── CanaryFailed          an engine or the frontend did not answer as the new name
    ├── BusError                  NATS could not be used
    │   ├── BusUnreachable        the first connection could not be made in time
    │   ├── PermissionDenied      NATS refused the credentials, a publish or a subscribe
    │   └── InsecureConnection    the link would expose credentials, or the fleet
    ├── NoCoordinator             nobody answered on the fleet's request subjects
    │   └── AuditStreamMissing    the fleet has no audit stream yet
    ├── Busy                      the coordinator's queue of waiting requests is full
    ├── NoCapacity                an engine cannot hold one more adapter
    ├── MalformedReply            a reply to a request was not a valid answer
    ├── DigestMismatch            a worker sees other adapter bytes than the request's digest
    ├── FetchFailed               an agent could not fetch an adapter from the fleet's store
    ├── DuplicateWorker           another live agent holds this agent's worker id
    ├── QuorumNotReached          live world sizes did not reach the expected sum in time
    ├── FrontendUnverified        the frontend did not list an adapter in time
    └── StartFailed               a part of the embedded stack or testbed did not start
        └── NatsServerMissing     no nats-server binary to start

An orchestrator using :class:`~lorabus.UpdateClient` meets ``BusUnreachable``
and ``PermissionDenied`` when connecting, ``NoCoordinator`` from ``status()``,
and ``MalformedReply`` from either call when what answered sent something that
does not decode; ``update()`` returns a failed result instead of raising, and
:meth:`LorabusError.from_info` turns that result's error into the matching
exception for code that prefers raising.

Each code belongs to one class, the one that sets ``code``: that is what
:meth:`LorabusError.from_info` returns for it, and the map from code to class
is read from the classes. A code no class sets (``phase_timeout``, say) comes
back as the root carrying that code. A class that sets none is a finer kind
of its parent and crosses the bus as the parent's code: ``StaleMembership`` as
``stale_version``, ``AuditStreamMissing`` as ``no_coordinator``,
``MalformedReply`` and ``StartFailed`` as the root's ``internal``.
``BusError`` sets none either (each of its subclasses is a code of its own),
and ``InsecureConnection`` is a ``BadRequest`` as well as a ``BusError``: an
option that cannot be used as given, it crosses the bus as ``bad_request``.
"""

from __future__ import annotations

from lorabus.schemas.errors import ErrorCode, ErrorInfo

__all__ = [
    "AuditStreamMissing",
    "BadRequest",
    "BusError",
    "BusUnreachable",
    "Busy",
    "CanaryFailed",
    "DigestMismatch",
    "DuplicateWorker",
    "EngineError",
    "ErrorCode",
    "ErrorInfo",
    "FetchFailed",
    "FrontendUnverified",
    "InsecureConnection",
    "LorabusError",
    "MalformedReply",
    "NatsServerMissing",
    "NoCapacity",
    "NoCoordinator",
    "NotListed",
    "PermissionDenied",
    "QuorumNotReached",
    "StaleMembership",
    "StaleVersion",
    "StartFailed",
    "TorchMissing",
]


class LorabusError(Exception):
    """Root of every lorabus exception; ``code`` says which kind it is."""

    code: ErrorCode = ErrorCode.INTERNAL

    def info(self) -> ErrorInfo:
        """The error as it crosses the bus."""
        return ErrorInfo(code=self.code, message=str(self))

    @classmethod
    def from_info(cls, info: ErrorInfo) -> LorabusError:
        """The exception for an error received as data (``result.error``, say):
        the class of the tree for its code, else the root carrying the code."""
        kind = _CLASS_OF_CODE.get(info.code)
        if kind is not None:
            return kind(info.message)
        error = LorabusError(info.message)
        error.code = info.code
        return error


class BadRequest(LorabusError):
    """Raised when an update request or an option cannot be used as given."""

    code = ErrorCode.BAD_REQUEST


class StaleVersion(BadRequest):
    """Raised when a request asks for a version older than the committed one."""

    code = ErrorCode.STALE_VERSION


class StaleMembership(StaleVersion):
    """Raised, before joining a rank group, when a rank map's membership_version
    is not the expected one or not the trainer's: fetch the newest result's rank map."""


class TorchMissing(BadRequest):
    """A rank group was joined without torch installed (``lorabus[torch]``)."""


class EngineError(LorabusError):
    """Raised when an engine call fails; ``retryable`` says whether to try again."""

    code = ErrorCode.ENGINE_ERROR

    def __init__(self, message: str, *, retryable: bool = False, status: int | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.status = status


class NotListed(EngineError):
    """Raised when an engine accepted a load but its adapter list does not show it."""

    code = ErrorCode.NOT_LISTED


class CanaryFailed(EngineError):
    """Raised when an engine (or the frontend) did not answer a one-token
    generation with an adapter's served name as that name."""

    code = ErrorCode.CANARY_FAILED


class BusError(LorabusError):
    """Raised when NATS cannot be used."""


class BusUnreachable(BusError):
    """Raised when the first connection to NATS cannot be made in time."""

    code = ErrorCode.BUS_UNREACHABLE


class PermissionDenied(BusError):
    """Raised when NATS refuses the credentials, or a publish or subscribe."""

    code = ErrorCode.PERMISSION_DENIED


class InsecureConnection(BusError, BadRequest):
    """Raised instead of sending credentials in the clear to a remote host, or of
    connecting to one without any (unless the user allowed it)."""


class NoCoordinator(LorabusError):
    """Raised when no coordinator answers on the fleet's request subjects."""

    code = ErrorCode.NO_COORDINATOR


class Busy(LorabusError):
    """Raised when the coordinator's queue of waiting update requests is full
    (``--max-queued``): nothing was queued, the same request may be sent again later."""

    code = ErrorCode.BUSY


class NoCapacity(LorabusError):
    """Raised when an engine cannot hold one more adapter: what it holds is
    all committed, kept or being loaded, and its capacity is reached."""

    code = ErrorCode.NO_CAPACITY


class MalformedReply(LorabusError):
    """Raised when a reply to a request does not decode as the expected answer:
    whatever answered is not a coordinator of this wire version, or lies."""


class DigestMismatch(LorabusError):
    """An agent's host shows other bytes at the adapter path than the request's
    digest (or the coordinator found members that disagree)."""

    code = ErrorCode.DIGEST_MISMATCH


class FetchFailed(LorabusError):
    """An agent could not fetch an adapter from the fleet's object store (gone,
    unreachable, too slow, or not what its name says): nothing was loaded."""

    code = ErrorCode.FETCH_FAILED


class DuplicateWorker(LorabusError):
    """Raised in an agent that the coordinator refused: another live agent holds its worker id."""

    code = ErrorCode.DUPLICATE_WORKER


class AuditStreamMissing(NoCoordinator):
    """Raised when the fleet has no audit stream (no coordinator has run yet)."""


class QuorumNotReached(LorabusError):
    """Raised when live, ready world sizes do not sum to the expected size in time."""

    code = ErrorCode.QUORUM_TIMEOUT


class FrontendUnverified(LorabusError):
    """Raised when the frontend did not list a model before the deadline."""

    code = ErrorCode.VERIFY_TIMEOUT


class StartFailed(LorabusError):
    """Raised when a part of the embedded stack or testbed does not start."""


class NatsServerMissing(StartFailed):
    """Raised when the embedded stack finds no nats-server binary."""


def _class_of_code(root: type[LorabusError]) -> dict[ErrorCode, type[LorabusError]]:
    """Each code set by a class of the tree under ``root``, to that class."""
    owners: dict[ErrorCode, type[LorabusError]] = {}
    kinds = [root]
    while kinds:
        kind = kinds.pop()
        kinds.extend(kind.__subclasses__())
        if "code" in vars(kind) and owners.setdefault(kind.code, kind) is not kind:
            raise TypeError(
                f"{owners[kind.code].__name__} and {kind.__name__} both set code {kind.code}"
            )
    return owners


_CLASS_OF_CODE = _class_of_code(LorabusError)
"""Read when this module is imported, so it holds the tree drawn above and
nothing else: a subclass defined elsewhere crosses the bus as the code it
inherits or sets, and comes back as this tree's class of that code, or as
the root carrying it."""
