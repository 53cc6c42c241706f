"""lorabus: roll LoRA adapters out across a fleet of inference workers over NATS.

The orchestrator's side, in full::

    from lorabus import UpdateClient

    async with await UpdateClient.connect("nats://127.0.0.1:4222", fleet="prod") as bus:
        result = await bus.update("policy", "/ckpt/step_42", version=42)
        if result.committed:
            rebuild_broadcast_group(result.rank_map)

What is public is ``__all__`` below, and ``lorabus.rank_group`` (the rank map
as a ``torch.distributed`` group, extra ``torch``). Everything else is for
running the fleet, not for calling it, and may change: the parts
(``lorabus.agents``, ``lorabus.coordinator``, the wire contract in
``lorabus.schemas``), the layers they share (``lorabus.runtime``,
``lorabus.bus``, ``lorabus.security``, ``lorabus.adapters``,
``lorabus.audit``), the command (``lorabus.cli``) and the development tools
(``lorabus.testbed``).
"""

from lorabus._version import __version__
from lorabus.bus.options import BusOptions
from lorabus.client import UpdateClient
from lorabus.errors import (
    BadRequest,
    BusError,
    BusUnreachable,
    Busy,
    CanaryFailed,
    DigestMismatch,
    EngineError,
    InsecureConnection,
    LorabusError,
    MalformedReply,
    NoCoordinator,
    PermissionDenied,
    StaleVersion,
)
from lorabus.schemas import (
    ErrorCode,
    ErrorInfo,
    FleetStatus,
    MemberStatus,
    RankEntry,
    RankMap,
    UpdateMode,
    UpdateResult,
    UpdateStatus,
    WorkerOutcome,
)

__all__ = [
    "BadRequest",
    "BusError",
    "BusOptions",
    "BusUnreachable",
    "Busy",
    "CanaryFailed",
    "DigestMismatch",
    "EngineError",
    "ErrorCode",
    "ErrorInfo",
    "FleetStatus",
    "InsecureConnection",
    "LorabusError",
    "MalformedReply",
    "MemberStatus",
    "NoCoordinator",
    "PermissionDenied",
    "RankEntry",
    "RankMap",
    "StaleVersion",
    "UpdateClient",
    "UpdateMode",
    "UpdateResult",
    "UpdateStatus",
    "WorkerOutcome",
    "__version__",
]
