"""Every NATS subject lorabus uses, built in one place.

Callers never format subjects themselves: a typo in one f-string would make a
command vanish silently (core NATS drops what nobody subscribed to).
"""

from __future__ import annotations

import re

import msgspec

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

DEFAULT_FLEET = "default"
"""The fleet of a process that names none."""


_TENANT = re.compile(r"^[A-Za-z0-9-]{1,64}$")


def check_tenant(value: str) -> str:
    """Return ``value`` if it can name a tenant, else raise ValueError. As a
    token, without '_': a tenant's store is named ``<...>_adapters_t_<tenant>``,
    and a '_' in it could make that another fleet's or tenant's store name."""
    if not _TENANT.fullmatch(value):
        raise ValueError(f"tenant {value!r} is not valid: use 1-64 letters, digits or '-'")
    return value


def check_token(kind: str, value: str) -> str:
    """Return ``value`` if it can stand as one subject token, else raise ValueError.

    Worker ids and fleet names become subject tokens, so dots, wildcards and
    spaces would change which subscribers a message reaches.
    """
    if not _TOKEN.fullmatch(value):
        raise ValueError(f"{kind} {value!r} is not valid: use 1-64 letters, digits, '_' or '-'")
    return value


class Subjects(msgspec.Struct, frozen=True):
    """The subjects of one fleet: ``<prefix>.<fleet>.<family>[.<worker>]``."""

    fleet: str
    prefix: str = "lorabus"
    store: str = ""
    """The tenant whose object store :meth:`adapter_store` names ("": the
    fleet's own): each tenant pushes into a store of its own (:meth:`for_store`)."""

    def __post_init__(self) -> None:
        check_token("fleet", self.fleet)
        for part in self.prefix.split("."):
            check_token("subject prefix part", part)
        if self.store:
            check_tenant(self.store)

    def for_store(self, tenant: str) -> Subjects:
        """These subjects, with :meth:`adapter_store` naming ``tenant``'s store
        ("": the fleet's own)."""
        return msgspec.structs.replace(self, store=tenant)

    @property
    def _base(self) -> str:
        return f"{self.prefix}.{self.fleet}"

    def cmd(self) -> str:
        """Coordinator -> every agent of the fleet (one publish, NATS fans out)."""
        return f"{self._base}.cmd"

    def cmd_worker(self, worker_id: str) -> str:
        """Coordinator -> one agent: commands that name it (a pause), and re-sends."""
        return f"{self._base}.cmd.{worker_id}"

    def ack(self, worker_id: str) -> str:
        return f"{self._base}.ack.{worker_id}"

    def ack_any(self) -> str:
        return f"{self._base}.ack.*"

    def heartbeat(self, worker_id: str) -> str:
        return f"{self._base}.hb.{worker_id}"

    def heartbeat_any(self) -> str:
        return f"{self._base}.hb.*"

    def update_request(self) -> str:
        """Orchestrator -> coordinator, request/reply; the reply is the result."""
        return f"{self._base}.req.update"

    def status_request(self) -> str:
        """Anyone -> coordinator, request/reply; the reply is the fleet status."""
        return f"{self._base}.req.status"

    def result_request(self) -> str:
        """Orchestrator -> coordinator, request/reply: an update's outcome by id."""
        return f"{self._base}.req.result"

    def reset_request(self) -> str:
        """Operator -> coordinator, request/reply; the reply is a ``ResetResult``."""
        return f"{self._base}.req.reset"

    def tenant_request(self, tenant: str, kind: str) -> str:
        """Tenant ``tenant`` -> coordinator, request/reply: its ``update``,
        ``result`` or ``status`` requests, on a subject only it may publish
        on, so the subject proves who asks."""
        return f"{self._base}.tenant.{check_token('tenant', tenant)}.{kind}"

    def tenant_request_any(self, kind: str) -> str:
        return f"{self._base}.tenant.*.{kind}"

    def tenant_of(self, subject: str) -> str | None:
        """The tenant a tenant request's subject names (None: not one)."""
        head, _, rest = subject.partition(f"{self._base}.tenant.")
        tenant, dot, _kind = rest.partition(".")
        return tenant if not head and dot and _TOKEN.fullmatch(tenant) else None

    def coordinator_event(self, kind: str) -> str:
        """A coordinator's audit event: a subject only coordinators may publish on."""
        return f"{self._base}.evt.coordinator.{kind}"

    def agent_event(self, worker_id: str, kind: str) -> str:
        """An agent's audit event, on a subject that names it: only that agent may
        publish there, so the subject tells who sent the event."""
        return f"{self._base}.evt.agent.{worker_id}.{kind}"

    def state_bucket(self) -> str:
        """JetStream KV bucket of the fleet's durable state (leader, committed, in flight)."""
        return f"{self.prefix.replace('.', '_')}_{self.fleet}"

    def results_bucket(self) -> str:
        """JetStream KV bucket of update results, kept for late or repeated requests."""
        return f"{self.prefix.replace('.', '_')}_{self.fleet}_results"

    def adapter_store(self) -> str:
        """The fleet's JetStream object store of adapters, keyed by content
        digest; with :attr:`store`, that tenant's (``..._adapters_t_<tenant>``)."""
        own = f"{self.prefix.replace('.', '_')}_{self.fleet}_adapters"
        return f"{own}_t_{self.store}" if self.store else own

    def audit_stream(self) -> str:
        """JetStream stream that records the fleet's commands, acks and events."""
        return f"{self.prefix.replace('.', '_')}_{self.fleet}_audit"

    def audited(self) -> list[str]:
        """The subjects the audit stream captures (everything but heartbeats and requests)."""
        return [self.cmd(), f"{self.cmd()}.*", self.ack_any(), self.event_any()]

    def event_any(self) -> str:
        return f"{self._base}.evt.>"
