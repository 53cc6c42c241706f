"""Who may say what on a fleet's bus: the roles and their NATS permissions.

Least privilege, one identity per process:

- **coordinator**: publishes commands and its own events, replies to requests
  (update, status, result and reset),
  reads and writes the fleet's two KV buckets; hears heartbeats, acks and
  requests.
- **agent** of worker ``w``: publishes only its own ack, heartbeat and event
  subjects, reads the state bucket (the committed adapter, the leader's
  epoch) and writes nothing; hears only the broadcast and its own command
  subject.
- **orchestrator**: sends update, status and result requests, hears their replies
  and the agents' heartbeats (for a status when no coordinator answers).
- **auditor**: reads the audit stream through consumers of its own.
- **operator**: creates the buckets and the audit stream, and changes their
  limits; asks the coordinator to reset an adapter's committed state (and for
  the fleet's status, and hears the heartbeats as the orchestrator does). The
  stream refuses delete and purge, so no role can erase the trail, and no
  running role may change its limits.

Of the inboxes, everyone hears only its own (its own inbox prefix), so no role reads
another's replies. These permissions are what ``lorabus auth init`` writes
into a server configuration, and what an operator of an existing NATS
deployment grants by hand (docs/security.md lists them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lorabus.schemas import Subjects


class Role(enum.StrEnum):
    COORDINATOR = "coordinator"
    AGENT = "agent"
    ORCHESTRATOR = "orchestrator"
    AUDITOR = "auditor"
    OPERATOR = "operator"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    """May reply to the requests it hears (the coordinator)."""


def identity_name(role: Role, worker_id: str | None = None) -> str:
    """``agent-w000`` for an agent, the role's name for the others."""
    if role is Role.AGENT:
        if not worker_id:
            raise ValueError("an agent's identity names its worker")
        return f"agent-{worker_id}"
    return str(role)


def permissions(
    role: Role, subjects: Subjects, *, inbox_prefix: str, worker_id: str | None = None
) -> Permissions:
    """What ``role`` (the agent of ``worker_id``) may publish and subscribe to."""
    state = _kv_stream(subjects.state_bucket())
    results = _kv_stream(subjects.results_bucket())
    audit = subjects.audit_stream()
    inbox = (f"{inbox_prefix}.>",)
    match role:
        case Role.COORDINATOR:
            return Permissions(
                publish=(
                    subjects.cmd(),
                    f"{subjects.cmd()}.*",
                    subjects.coordinator_event(">"),
                    *_kv_read(state),
                    *_kv_read(results),
                    f"$KV.{subjects.state_bucket()}.>",
                    f"$KV.{subjects.results_bucket()}.>",
                ),
                subscribe=(
                    subjects.heartbeat_any(),
                    subjects.ack_any(),
                    subjects.update_request(),
                    subjects.status_request(),
                    subjects.result_request(),
                    subjects.reset_request(),
                    *inbox,
                ),
                allow_responses=True,
            )
        case Role.AGENT:
            if worker_id is None:
                raise ValueError("an agent's permissions name its worker")
            return Permissions(
                publish=(
                    subjects.ack(worker_id),
                    subjects.heartbeat(worker_id),
                    subjects.agent_event(worker_id, ">"),
                    *_kv_read(state),
                ),
                subscribe=(subjects.cmd(), subjects.cmd_worker(worker_id), *inbox),
            )
        case Role.ORCHESTRATOR:
            return Permissions(
                publish=(
                    subjects.update_request(),
                    subjects.status_request(),
                    subjects.result_request(),
                ),
                subscribe=(*_heartbeats(subjects), *inbox),
            )
        case Role.AUDITOR:
            return Permissions(
                publish=(
                    f"$JS.API.STREAM.INFO.{audit}",
                    f"$JS.API.CONSUMER.CREATE.{audit}",
                    f"$JS.API.CONSUMER.CREATE.{audit}.>",
                    f"$JS.API.CONSUMER.DURABLE.CREATE.{audit}.>",
                    f"$JS.API.CONSUMER.INFO.{audit}.>",
                    f"$JS.API.CONSUMER.MSG.NEXT.{audit}.>",
                    f"$JS.API.CONSUMER.DELETE.{audit}.>",
                    f"$JS.ACK.{audit}.>",
                ),
                subscribe=inbox,
            )
        case Role.OPERATOR:
            streams = (state, results, audit)
            return Permissions(
                publish=(
                    "$JS.API.INFO",
                    *(f"$JS.API.STREAM.{verb}.{s}" for verb in _STREAM_ADMIN for s in streams),
                    subjects.reset_request(),
                    subjects.status_request(),
                ),
                subscribe=(*_heartbeats(subjects), *inbox),
            )
    raise ValueError(f"unknown role {role!r}")


_STREAM_ADMIN = ("CREATE", "UPDATE", "INFO")


def _heartbeats(subjects: Subjects) -> tuple[str, ...]:
    """What ``lorabus status`` hears when no coordinator answers. Heartbeats hold
    no secrets (world size, engine kind, paused and ready flags, adapter names,
    beat period, epoch seen, a random instance id), and hearing them changes
    nothing, so the roles that ask for the fleet's status may hear them too."""
    return (subjects.heartbeat_any(),)


def _kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def _kv_read(stream: str) -> tuple[str, ...]:
    return (
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.STREAM.MSG.GET.{stream}",
    )
