"""Who may say what on a fleet's bus: the roles and their NATS permissions.

Least privilege, one identity per process:

- **coordinator**: publishes commands and its own events, replies to requests
  (update, status, result and reset),
  reads and writes the fleet's two KV buckets; hears heartbeats, acks and
  requests.
- **agent** of worker ``w``: publishes only its own ack, heartbeat and event
  subjects, reads the state bucket (the committed adapter, the leader's
  epoch) and the adapter object store, and writes nothing; hears only the
  broadcast and its own command subject.
- **node** ``n`` (``lorabus auth init --node n=w000,w001``): one agent
  process driving several workers of its node: publishes its acks and
  heartbeats only on its node's subjects (a message there carries its
  workers', and the coordinator takes from it only theirs: the nodes file),
  and each of its workers' event subjects; reads as an agent does; hears the
  broadcast and each of its workers' command subjects.
- **orchestrator**: sends update, status and result requests, hears their replies
  and the agents' heartbeats (for a status when no coordinator answers);
  pushes adapters into the fleet's object store (which agents only read).
- **tenant** ``t`` (``lorabus auth init --tenant``): one trainer of a fleet
  shared by several: sends update, result and status requests on its own
  subjects only (which prove to the coordinator who asks: it holds them to
  the tenant's adapters and quotas, coordinator/tenants.py), and pushes
  adapters into the object store as the orchestrator does, but reads of it
  only a meta record by its subject (what a push checks first); hears
  nothing but its replies (no heartbeats: they name every tenant's
  adapters).
- **auditor**: reads the audit stream, message by message (direct gets): it
  creates no consumer, since a consumer's deliver subject would let it have
  JetStream publish stored commands wherever it names.
- **operator**: creates the buckets and the audit stream; asks the
  coordinator to reset an adapter's committed state (and for the fleet's
  status, and hears the heartbeats as the orchestrator does); reads the
  state bucket and the adapter store, to list what the store keeps. No role may
  change a stream's configuration: whoever may can aim JetStream (republish
  onto a KV key, seal a bucket, answer acks); a creation where the stream
  exists with another configuration is refused by the server. The stream
  refuses delete and purge, so no role can erase the trail.

Of the inboxes, everyone hears only its own (its own inbox prefix), so no role reads
another's replies. These permissions are what ``lorabus auth init`` writes
into a server configuration, and what an operator of an existing NATS
deployment grants by hand (docs/security.md lists them).

Permissions say what a client may publish, not where the answer to its
request goes: whoever answers (JetStream, or the coordinator) publishes to
the reply subject the requester chose, with the answerer's rights. So only
the coordinators live in the fleet's account, beside its streams and
buckets; every other role has an account of its own (one per agent) and
reaches the fleet's services through imports (:mod:`lorabus.security.accounts`).
Across accounts the server replaces each reply subject with one of its own
(``_R_...``) and carries the answer back into the requester's account: a
request can no longer aim an answer at a fleet subject. Those roles reach
JetStream under :data:`FLEET_JS_API` (an account without JetStream of its own
has its ``$JS.API`` answered by the server with "not enabled").
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from lorabus.schemas import Subjects

FLEET_JS_API = "JS.FLEET.API"
"""The JetStream API prefix, in every account but the fleet's, under which the
fleet's JetStream calls a role needs are imported (``js_api_prefix``)."""
JS_API = "$JS.API"


class Role(enum.StrEnum):
    COORDINATOR = "coordinator"
    AGENT = "agent"
    ORCHESTRATOR = "orchestrator"
    AUDITOR = "auditor"
    OPERATOR = "operator"
    TENANT = "tenant"
    NODE = "node"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    """May reply to the requests it hears (the coordinator)."""


def identity_name(role: Role, worker_id: str | None = None) -> str:
    """``agent-w000`` for an agent, ``tenant-a`` for a tenant and ``node-a``
    for a node (``worker_id`` names it), the role's name for the others."""
    if role in (Role.AGENT, Role.TENANT, Role.NODE):
        if not worker_id:
            raise ValueError(f"a{'n' if role is Role.AGENT else ''} {role}'s identity names it")
        return f"{role}-{worker_id}"
    return str(role)


def permissions(
    role: Role,
    subjects: Subjects,
    *,
    inbox_prefix: str,
    worker_id: str | None = None,
    tenants: Sequence[str] = (),
    node_workers: Sequence[str] = (),
) -> Permissions:
    """What ``role`` (the agent of ``worker_id``, or the tenant or node it
    names, with its ``node_workers``) may publish and subscribe to, in a
    fleet of ``tenants``, each with an adapter store of its own."""
    inbox = (f"{inbox_prefix}.>",)
    stores = adapter_stores(subjects, tenants)
    match role:
        case Role.TENANT:
            if worker_id is None:
                raise ValueError("a tenant's permissions name it")
            return Permissions(
                publish=(
                    *tenant_requests(subjects, worker_id),
                    # Its own store, which no other tenant writes.
                    *object_pushes(subjects.for_store(worker_id), FLEET_JS_API),
                ),
                subscribe=inbox,
            )
        case Role.COORDINATOR:
            return _coordinator(subjects, stores, inbox)
        case Role.AGENT:
            if worker_id is None:
                raise ValueError("an agent's permissions name its worker")
            return _agent(subjects, stores, worker_id, inbox)
        case Role.NODE:
            if worker_id is None or not node_workers:
                raise ValueError("a node's permissions name it and its workers")
            return _node(subjects, stores, worker_id, node_workers, inbox)
        case Role.ORCHESTRATOR:
            return _orchestrator(subjects, inbox)
        case Role.AUDITOR:
            return Permissions(publish=audit_reads(subjects, FLEET_JS_API), subscribe=inbox)
        case Role.OPERATOR:
            return _operator(subjects, stores, inbox)
    raise ValueError(f"unknown role {role!r}")


def adapter_stores(subjects: Subjects, tenants: Sequence[str] = ()) -> tuple[Subjects, ...]:
    """The fleet's adapter store, then each tenant's (``Subjects.for_store``)."""
    return (subjects, *(subjects.for_store(t) for t in sorted(tenants)))


def _coordinator(
    subjects: Subjects, stores: Sequence[Subjects], inbox: tuple[str, ...]
) -> Permissions:
    return Permissions(
        publish=(
            subjects.cmd(),
            f"{subjects.cmd()}.*",
            subjects.coordinator_event(">"),
            *kv_reads(subjects.state_bucket(), JS_API),
            *kv_reads(subjects.results_bucket(), JS_API),
            # A new leader checks the streams' settings (coordinator/streams.py).
            f"{JS_API}.STREAM.INFO.{subjects.audit_stream()}",
            # Admission looks for the object an update names; the
            # leader deletes those nothing keeps (coordinator/adapter_store.py).
            *(call for store in stores for call in object_deletes(store, JS_API)),
            f"$KV.{subjects.state_bucket()}.>",
            f"$KV.{subjects.results_bucket()}.>",
            # The leader's probe that the server still routes requests to it
            # (coordinator/service.py); it answers its own probe with nothing.
            subjects.status_request(),
        ),
        subscribe=(
            subjects.heartbeat_any(),
            subjects.ack_any(),
            subjects.update_request(),
            subjects.status_request(),
            subjects.result_request(),
            subjects.reset_request(),
            *(subjects.tenant_request_any(kind) for kind in TENANT_REQUESTS),
            *inbox,
        ),
        allow_responses=True,
    )


def _agent(
    subjects: Subjects, stores: Sequence[Subjects], worker_id: str, inbox: tuple[str, ...]
) -> Permissions:
    return Permissions(
        publish=(
            subjects.ack(worker_id),
            subjects.heartbeat(worker_id),
            subjects.agent_event(worker_id, ">"),
            *kv_reads(subjects.state_bucket(), FLEET_JS_API),
            *(call for store in stores for call in object_reads(store, FLEET_JS_API)),
        ),
        subscribe=(subjects.cmd(), subjects.cmd_worker(worker_id), *inbox),
    )


def _node(
    subjects: Subjects,
    stores: Sequence[Subjects],
    node: str,
    workers: Sequence[str],
    inbox: tuple[str, ...],
) -> Permissions:
    return Permissions(
        publish=(
            subjects.ack(node),
            subjects.heartbeat(node),
            *(subjects.agent_event(worker, ">") for worker in workers),
            *kv_reads(subjects.state_bucket(), FLEET_JS_API),
            *(call for store in stores for call in object_reads(store, FLEET_JS_API)),
        ),
        subscribe=(
            subjects.cmd(),
            *(subjects.cmd_worker(worker) for worker in workers),
            *inbox,
        ),
    )


def _orchestrator(subjects: Subjects, inbox: tuple[str, ...]) -> Permissions:
    return Permissions(
        publish=(
            subjects.update_request(),
            subjects.status_request(),
            subjects.result_request(),
            *object_writes(subjects, FLEET_JS_API),
        ),
        subscribe=(*_heartbeats(subjects), *inbox),
    )


def _operator(
    subjects: Subjects, stores: Sequence[Subjects], inbox: tuple[str, ...]
) -> Permissions:
    return Permissions(
        publish=(
            *stream_admin(subjects, FLEET_JS_API, stores),
            # What the stores hold and what keeps it (lorabus adapter list).
            *kv_reads(subjects.state_bucket(), FLEET_JS_API),
            *(call for store in stores for call in object_reads(store, FLEET_JS_API)),
            subjects.reset_request(),
            subjects.status_request(),
        ),
        subscribe=(*_heartbeats(subjects), *inbox),
    )


_STREAM_ADMIN = ("CREATE", "INFO")

TENANT_REQUESTS = ("update", "result", "status")
"""What a tenant may ask the coordinator, each on its own subject."""


def tenant_requests(subjects: Subjects, tenant: str) -> tuple[str, ...]:
    """The request subjects of ``tenant``: only it may publish there."""
    return tuple(subjects.tenant_request(tenant, kind) for kind in TENANT_REQUESTS)


def kv_reads(bucket: str, api: str) -> tuple[str, ...]:
    """The JetStream calls that read KV ``bucket`` (``api``: where JetStream is)."""
    stream = f"KV_{bucket}"
    return (
        f"{api}.STREAM.INFO.{stream}",
        f"{api}.DIRECT.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}.>",
        f"{api}.STREAM.MSG.GET.{stream}",
    )


def object_reads(subjects: Subjects, api: str) -> tuple[str, ...]:
    """The JetStream calls that read the fleet's adapter object store, one
    stored message at a time (direct gets): no consumer, so no deliver
    subject to aim."""
    stream = f"OBJ_{subjects.adapter_store()}"
    return (
        f"{api}.STREAM.INFO.{stream}",
        f"{api}.DIRECT.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}.>",
    )


def object_writes(subjects: Subjects, api: str) -> tuple[str, ...]:
    """What ``lorabus adapter push`` publishes: the object's chunks and its
    meta record (JetStream answers each with its ack, into the pusher's own
    account), and the reads it makes first. No purge nor delete, and the
    store's stream refuses rollup headers and a second message on any
    subject: a publish there adds an object, never removes or replaces one
    (lorabus.adapters.store)."""
    return (*object_reads(subjects, api), *object_subjects(subjects))


def object_pushes(subjects: Subjects, api: str) -> tuple[str, ...]:
    """What a tenant's push publishes: as ``object_writes``, but of the reads
    only the one a push makes first, an object's meta record by its subject.
    No read by sequence nor of the stream's subjects: a tenant learns nothing
    of what the others stored, not their digests, not their bytes."""
    bucket = subjects.adapter_store()
    return (f"{api}.DIRECT.GET.OBJ_{bucket}.$O.{bucket}.M.>", *object_subjects(subjects))


def object_deletes(subjects: Subjects, api: str) -> tuple[str, ...]:
    """What the leader needs to delete an object of the adapter store: the
    reads, and a purge of its meta record and of its chunks. Only the
    coordinator, the fleet's most trusted part, may purge the store; it
    publishes nothing there."""
    bucket = subjects.adapter_store()
    return (*object_reads(subjects, api), f"{api}.STREAM.PURGE.OBJ_{bucket}")


def object_subjects(subjects: Subjects) -> tuple[str, ...]:
    """The subjects the adapter object store keeps: chunks and meta records."""
    bucket = subjects.adapter_store()
    return (f"$O.{bucket}.C.>", f"$O.{bucket}.M.>")


def audit_reads(subjects: Subjects, api: str) -> tuple[str, ...]:
    """The JetStream calls that read the audit stream, one stored message (or
    one batch) at a time: no consumer, so no deliver subject to aim."""
    audit = subjects.audit_stream()
    return (f"{api}.STREAM.INFO.{audit}", f"{api}.DIRECT.GET.{audit}")


def stream_admin(subjects: Subjects, api: str, stores: Sequence[Subjects] = ()) -> tuple[str, ...]:
    """The JetStream calls that create the fleet's buckets, adapter stores
    (``stores``: by default the fleet's alone) and audit stream (``lorabus
    provision``): no update, which could aim JetStream."""
    streams = (
        f"KV_{subjects.state_bucket()}",
        f"KV_{subjects.results_bucket()}",
        *(f"OBJ_{store.adapter_store()}" for store in stores or (subjects,)),
        subjects.audit_stream(),
    )
    return (f"{api}.INFO", *(f"{api}.STREAM.{verb}.{s}" for verb in _STREAM_ADMIN for s in streams))


def _heartbeats(subjects: Subjects) -> tuple[str, ...]:
    """What ``lorabus status`` hears when no coordinator answers. Heartbeats hold
    no secrets (world size, engine kind, paused and ready flags, adapter names,
    beat period, epoch seen, a random instance id), and hearing them changes
    nothing, so the roles that ask for the fleet's status may hear them too."""
    return (subjects.heartbeat_any(),)
