"""The NATS accounts of a fleet: who lives beside its streams, and what crosses over.

Permissions bound what each client publishes; they do not bound where an
answer goes. JetStream and the coordinator both answer to the reply subject
the requester chose, with their own rights, so in one shared account any
role that may ask JetStream (or the coordinator) something could have the
answer written into the leader record, a command subject or the audit trail.

Accounts close that. The fleet's account holds the coordinators, the two KV
buckets and the audit stream, and nobody else. The orchestrator, the
auditor, the operator, each tenant and each agent have an account of their own, and
reach the fleet only through what it exports to them:

- *services* (request and reply): the coordinator's requests, and the few
  JetStream calls a role needs, imported under :data:`~lorabus.security.roles.FLEET_JS_API`.
  The server gives each request that crosses an account a reply subject of
  its own (``_R_...``) and carries the answer back into the requester's
  account, so an answer lands nowhere but there;
- *streams* (one way): commands into each agent's account (each imports the
  broadcast and its own subject), and each agent's acks, heartbeats and
  events into the fleet's account (where the audit stream records them),
  heartbeats also to the orchestrator and the operator for ``lorabus status``.

An account per agent, not one for all agents: an answer carried back into a
shared account could reach another agent's command subject there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lorabus.schemas import Subjects
from lorabus.security.roles import (
    FLEET_JS_API,
    JS_API,
    Role,
    adapter_stores,
    audit_reads,
    kv_reads,
    object_reads,
    object_subjects,
    object_writes,
    stream_admin,
    tenant_requests,
)


@dataclass(frozen=True)
class Export:
    subject: str
    service: bool
    to: tuple[str, ...]
    """The accounts that may import it."""
    streamed: bool = False
    """A service that answers one request with several messages (a batch read)."""


@dataclass(frozen=True)
class Import:
    subject: str
    service: bool
    account: str
    """The exporting account."""
    local: str = ""
    """The subject in the importing account, when it differs."""


@dataclass(frozen=True)
class Account:
    name: str
    jetstream: bool = False
    exports: list[Export] = field(default_factory=list)
    imports: list[Import] = field(default_factory=list)


@dataclass(frozen=True)
class FleetAccounts:
    accounts: dict[str, Account]
    """By account name, the fleet's first."""
    of_role: dict[tuple[Role, str | None], str]
    """The account of each (role, worker id) identity."""


def fleet_accounts(
    subjects: Subjects,
    worker_ids: Sequence[str],
    tenants: Sequence[str] = (),
    nodes: Mapping[str, Sequence[str]] | None = None,
) -> FleetAccounts:
    """The accounts of ``subjects``' fleet with agents ``worker_ids``, tenants
    ``tenants`` and node agents ``nodes`` (each with its workers)."""
    layout = _Layout(subjects, worker_ids, tenants, nodes or {})
    _share_requests(layout, subjects)
    _share_jetstream(layout, subjects)
    _share_agent_streams(layout, subjects)
    of_role: dict[tuple[Role, str | None], str] = {
        (Role.COORDINATOR, None): layout.fleet.name,
        (Role.ORCHESTRATOR, None): layout.orchestrator.name,
        (Role.AUDITOR, None): layout.auditor.name,
        (Role.OPERATOR, None): layout.operator.name,
        **{(Role.AGENT, w): a.name for w, a in layout.agents.items()},
        **{(Role.TENANT, t): a.name for t, a in layout.tenants.items()},
        **{(Role.NODE, n): a.name for n, a in layout.nodes.items()},
    }
    return FleetAccounts(layout.by_name, of_role)


class _Layout:
    """A fleet's accounts while what crosses between them is added."""

    def __init__(
        self,
        subjects: Subjects,
        worker_ids: Sequence[str],
        tenants: Sequence[str],
        nodes: Mapping[str, Sequence[str]],
    ) -> None:
        base = f"LORABUS_{subjects.fleet.upper().replace('-', '_')}"
        self.fleet = Account(base, jetstream=True)
        self.orchestrator = Account(f"{base}_ORCHESTRATOR")
        self.auditor = Account(f"{base}_AUDITOR")
        self.operator = Account(f"{base}_OPERATOR")
        self.agents = {w: Account(f"{base}_AGENT_{w}") for w in worker_ids}
        self.tenants = {t: Account(f"{base}_TENANT_{t}") for t in tenants}
        self.nodes = {n: Account(f"{base}_NODE_{n}") for n in nodes}
        self.node_workers = {n: tuple(w) for n, w in nodes.items()}
        every = (
            self.fleet,
            self.orchestrator,
            self.auditor,
            self.operator,
            *self.agents.values(),
            *self.tenants.values(),
            *self.nodes.values(),
        )
        self.by_name = {a.name: a for a in every}

    def share(
        self,
        owner: Account,
        subject: str,
        to: Sequence[str],
        *,
        service: bool,
        streamed: bool = False,
    ) -> None:
        """Export ``subject`` of ``owner`` to the accounts ``to``, and import it
        there (a JetStream call under the fleet's JetStream prefix)."""
        # One export per subject: a second would replace the first's importers.
        same = [i for i, e in enumerate(owner.exports) if e.subject == subject]
        if same:
            earlier = owner.exports[same[0]]
            owner.exports[same[0]] = Export(
                subject,
                service,
                tuple(dict.fromkeys((*earlier.to, *to))),
                earlier.streamed or streamed,
            )
        else:
            owner.exports.append(Export(subject, service, tuple(to), streamed))
        js = subject.startswith(JS_API + ".")
        local = FLEET_JS_API + subject.removeprefix(JS_API) if js else ""
        for name in to:
            imports = self.by_name[name].imports
            if not any(i.subject == subject and i.account == owner.name for i in imports):
                imports.append(Import(subject, service, owner.name, local))


def _share_requests(layout: _Layout, subjects: Subjects) -> None:
    """The coordinator's request subjects, each to the roles that may ask."""
    fleet, orchestrator = layout.fleet, layout.orchestrator.name
    listeners = [orchestrator, layout.operator.name]
    layout.share(fleet, subjects.update_request(), [orchestrator], service=True)
    layout.share(fleet, subjects.result_request(), [orchestrator], service=True)
    layout.share(fleet, subjects.status_request(), listeners, service=True)
    layout.share(fleet, subjects.reset_request(), [layout.operator.name], service=True)
    # Each tenant's own request subjects, to its account alone: the subject
    # a request arrives on proves which tenant asks.
    for tenant, account in layout.tenants.items():
        for subject in tenant_requests(subjects, tenant):
            layout.share(fleet, subject, [account.name], service=True)


def _share_jetstream(layout: _Layout, subjects: Subjects) -> None:
    """The fleet's JetStream calls each role needs, as services of the fleet's account."""
    fleet, operator = layout.fleet, layout.operator.name
    # The operator reads them too, to list what the store keeps (lorabus adapter list).
    readers = [
        *(a.name for a in layout.agents.values()),
        *(a.name for a in layout.nodes.values()),
        operator,
    ]
    for subject in kv_reads(subjects.state_bucket(), JS_API):
        layout.share(fleet, subject, readers, service=True)
    stores = adapter_stores(subjects, list(layout.tenants))
    for subject in (s for store in stores for s in object_reads(store, JS_API)):
        # A batch read answers with many messages: the import must let them all back.
        layout.share(fleet, subject, readers, service=True, streamed=".DIRECT.GET." in subject)
    # The pusher's chunks and meta record reach the store's stream in the
    # fleet's account as requests: JetStream's acks come back into its own.
    for subject in object_writes(subjects, JS_API):
        layout.share(fleet, subject, [layout.orchestrator.name], service=True)
    # A tenant pushes too, into its own store alone. Its account imports that
    # store's reads by subject as they are exported (one export per subject:
    # a narrower second one would overlap it), and its user's permissions
    # narrow them to what a push reads: a meta record by its subject
    # (roles.object_pushes).
    for tenant, account in layout.tenants.items():
        own = subjects.for_store(tenant)
        stream = f"OBJ_{own.adapter_store()}"
        for subject in (*object_subjects(own), f"{JS_API}.DIRECT.GET.{stream}.>"):
            streamed = ".DIRECT.GET." in subject
            layout.share(fleet, subject, [account.name], service=True, streamed=streamed)
    for subject in audit_reads(subjects, JS_API):
        # A batch read answers with many messages: the import must let them all back.
        streamed = ".DIRECT.GET." in subject
        layout.share(fleet, subject, [layout.auditor.name], service=True, streamed=streamed)
    for subject in stream_admin(subjects, JS_API, stores):
        layout.share(fleet, subject, [operator], service=True)


def _share_agent_streams(layout: _Layout, subjects: Subjects) -> None:
    """Commands into each agent's account, and its acks, events and heartbeats out."""
    fleet = layout.fleet
    agent_names = tuple(a.name for a in (*layout.agents.values(), *layout.nodes.values()))
    listeners = [layout.orchestrator.name, layout.operator.name]
    # Commands: each agent's account takes the broadcast and its own subject only.
    fleet.exports.extend(
        [
            Export(subjects.cmd(), False, agent_names),
            Export(f"{subjects.cmd()}.*", False, agent_names),
        ]
    )
    for worker, agent in layout.agents.items():
        agent.imports.extend(
            [
                Import(subjects.cmd(), False, fleet.name),
                Import(subjects.cmd_worker(worker), False, fleet.name),
            ]
        )
        layout.share(agent, subjects.ack(worker), [fleet.name], service=False)
        layout.share(agent, subjects.agent_event(worker, ">"), [fleet.name], service=False)
        layout.share(agent, subjects.heartbeat(worker), [fleet.name, *listeners], service=False)
    # A node's account: the broadcast and each of its workers' command
    # subjects in; its acks and beats (on its own subjects) and each of its
    # workers' events out.
    for node, account in layout.nodes.items():
        workers = layout.node_workers[node]
        account.imports.append(Import(subjects.cmd(), False, fleet.name))
        for worker in workers:
            account.imports.append(Import(subjects.cmd_worker(worker), False, fleet.name))
            layout.share(account, subjects.agent_event(worker, ">"), [fleet.name], service=False)
        layout.share(account, subjects.ack(node), [fleet.name], service=False)
        layout.share(account, subjects.heartbeat(node), [fleet.name, *listeners], service=False)


def js_api_prefix(role: Role) -> str:
    """Where ``role`` reaches the fleet's JetStream ("" for the default, ``$JS.API``)."""
    return "" if role is Role.COORDINATOR else FLEET_JS_API
