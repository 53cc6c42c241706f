"""Tenants: trainers that share one fleet, each held to its own adapters and quotas.

A tenant asks on subjects that name it (``<prefix>.<fleet>.tenant.<name>.update``,
``.result`` and ``.status``), on which only it may publish: ``lorabus auth init
--tenant NAME=PATTERN`` gives each tenant an account that imports its own
three and nothing else of the coordinator's. So the subject proves who asks,
and nothing in a message is taken for it. The leader holds each request to
the tenant's record (:class:`Tenant`, from the file ``--tenants`` names):

- **update**: its adapter must match the tenant's pattern, and no other
  tenant's, its path name an object of the fleet's store (or lie under
  the tenant's ``roots``, directories on the workers), and its update id
  begin with ``<name>:`` (so no tenant can take an id another will use;
  the orchestrator's own subject refuses such ids too); ``forbidden``
  otherwise, on arrival, before anything is looked up.
  A new id may keep at most ``max_keep`` versions, and name a new adapter
  only while the tenant has fewer than ``max_adapters`` (committed, queued
  or running); ``quota`` otherwise, at its turn to join the book. Those
  refusals are answered at once, are not kept as the id's result, and are
  recorded as ``request_refused`` events; nor is any other answer a tenant
  gets without its update running kept. At most ``max_queued`` of its
  requests wait; one more is answered ``busy`` (``book.py``).
- **result**: an id that is not the tenant's is answered ``unknown``, as an
  id nobody used (its own ids only its own subject took).
- **status**: only the tenant's adapters and updates; each member's list
  shows only the tenant's served names, and no member's reasons.

The generic orchestrator role keeps its own subjects and its trust: a fleet of
one team needs no tenants.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from lorabus.adapters.bus_paths import BUS_SCHEME, store_of
from lorabus.schemas import (
    UNKNOWN,
    ErrorCode,
    ErrorInfo,
    FleetStatus,
    UpdateResult,
    check_tenant,
)
from lorabus.schemas.tenants import ID_SEPARATOR, Tenant, decode_tenants


class Tenants:
    """Every tenant of the fleet, by name (none: a fleet of one team)."""

    def __init__(self, tenants: Mapping[str, Tenant] | None = None) -> None:
        self.by_name = dict(tenants or {})
        for name in self.by_name:
            check_tenant(name)

    @classmethod
    def load(cls, path: str) -> Tenants:
        """The tenants file at ``path`` ("": none): ``{"<name>": {"adapters":
        "<pattern>", ...}, ...}``. ValueError, saying what is wrong, for a
        file that cannot be read or holds anything else."""
        if not path:
            return cls()
        try:
            with open(path, "rb") as file:
                return cls(decode_tenants(file.read()))
        except (OSError, msgspec.DecodeError, ValueError) as exc:
            raise ValueError(f"tenants file {path}: {exc}") from None

    def get(self, name: str) -> Tenant | None:
        return self.by_name.get(name)

    def owners(self, adapter: str) -> list[str]:
        """The tenants whose pattern matches ``adapter``."""
        return [name for name, tenant in self.by_name.items() if tenant.owns(adapter)]

    def __bool__(self) -> bool:
        return bool(self.by_name)


def owns_update_id(name: str, update_id: str) -> bool:
    return update_id.startswith(name + ID_SEPARATOR)


def forbidden(
    name: str, tenants: Tenants, update_id: str, adapter: str, path: str
) -> ErrorInfo | None:
    """Why tenant ``name`` may not ask for this update at all, or None: it is
    no known tenant, the id is not its own, the adapter is not (its
    pattern must match it, and no other tenant's may), or its path is
    neither an object of the fleet's store nor under the tenant's roots. Any
    other path on the workers would make every agent a deputy that loads
    whatever file a tenant names, another tenant's adapter among them."""
    tenant = tenants.get(name)
    if tenant is None:
        return _forbidden(f"no tenant {name!r} is known to this fleet's coordinator")
    if not owns_update_id(name, update_id):
        return _forbidden(
            f"tenant {name!r} may only use update ids that begin with {name + ID_SEPARATOR!r}"
        )
    if not tenant.owns(adapter):
        return _forbidden(
            f"tenant {name!r} may only update adapters named {tenant.adapters!r}, not {adapter!r}"
        )
    if not path.startswith(BUS_SCHEME) and not tenant.may_load(path):
        return _forbidden(
            f"tenant {name!r} may load adapters only from its own store "
            f"({BUS_SCHEME}{name}/<digest>: `lorabus adapter push` gives it)"
            + (f" or under its roots {tenant.roots}" if tenant.roots else "")
            + f", not from {path[:256]!r}"
        )
    if path.startswith(BUS_SCHEME) and _store_of(path) not in (name, None):
        return _forbidden(
            f"tenant {name!r} may load adapters only from its own store "
            f"({BUS_SCHEME}{name}/<digest>), not from {path[:256]!r}"
        )
    if len(tenants.owners(adapter)) > 1:
        return _forbidden(
            f"adapter {adapter!r} matches the patterns of several tenants: no tenant may "
            "update it until the tenants file says whose it is"
        )
    return None


def forbidden_on_generic(tenants: Tenants, update_id: str, path: str = "") -> ErrorInfo | None:
    """Why an update on the orchestrator's own subject may not use
    ``update_id`` or ``path``: the ids that begin with a tenant's name and
    ``:`` are that tenant's, and so are the objects of its store."""
    owner, sep, _ = update_id.partition(ID_SEPARATOR)
    if sep and tenants.get(owner) is not None:
        return _forbidden(
            f"update ids that begin with {owner + ID_SEPARATOR!r} are tenant {owner!r}'s"
        )
    if _store_of(path):
        return _forbidden(f"{path[:256]!r} names an object of a tenant's store: it is theirs")
    return None


def _store_of(path: str) -> str | None:
    """The tenant whose store ``path`` names ("": the fleet's; None: not a
    valid bus path, which the plan refuses as bad_request)."""
    try:
        return store_of(path)
    except ValueError:
        return None


def over_quota(
    name: str, tenant: Tenant, adapter: str, keep: int, adapters_held: Iterable[str]
) -> ErrorInfo | None:
    """Why a new update of tenant ``name`` would exceed its quotas, or None.
    ``keep``: the versions it would keep (the request's, else the
    coordinator's); ``adapters_held``: the adapters the fleet has committed,
    queued or running, of every tenant."""
    if keep > tenant.max_keep:
        return ErrorInfo(
            code=ErrorCode.QUOTA,
            message=f"tenant {name!r} may keep at most {tenant.max_keep} versions, not {keep}",
        )
    own = {a for a in adapters_held if tenant.owns(a)}
    if adapter not in own and len(own) >= tenant.max_adapters:
        return ErrorInfo(
            code=ErrorCode.QUOTA,
            message=f"tenant {name!r} has {len(own)} adapters, its quota (max_adapters): "
            f"{adapter!r} would be one more",
        )
    return None


def _forbidden(message: str) -> ErrorInfo:
    return ErrorInfo(code=ErrorCode.FORBIDDEN, message=message)


def result_for(name: str, result: UpdateResult) -> UpdateResult:
    """``result`` as tenant ``name`` may see it: its own ids' (only its own
    subject, which it alone may publish on, takes ids that begin with its
    name), and another's as ``unknown``, as an id nobody used."""
    if owns_update_id(name, result.update_id):
        return result
    return UpdateResult(update_id=result.update_id, status=UNKNOWN, adapter="", version=None)


def status_for(tenant: Tenant, status: FleetStatus) -> FleetStatus:
    """The fleet's status as a tenant may see it: its own adapters and
    updates; the members' sizes, engines and flags, each member's list cut
    to the tenant's served names, and none of the reasons an operator reads."""
    adapters = [a for a in status.adapters if tenant.owns(a.adapter)]
    served = {name for a in adapters for name in (a.served_name, *a.kept)}
    running = [u for u in status.running if tenant.owns(u.adapter)]
    own_ids = {u.update_id for u in running}
    latest_own = status.committed_adapter is not None and tenant.owns(status.committed_adapter)
    in_flight = status.in_flight if status.in_flight in own_ids else None
    members = [
        msgspec.structs.replace(
            m,
            adapters=[n for n in m.adapters if n in served],
            missing=[n for n in m.missing if n in served],
            unready_reason="",
            unreadable_state="",
            rank_offset=m.rank_offset if latest_own else None,
        )
        for m in status.members
    ]
    return msgspec.structs.replace(
        status,
        members=members,
        committed_adapter=status.committed_adapter if latest_own else None,
        committed_version=status.committed_version if latest_own else None,
        rank_map=status.rank_map if latest_own else None,
        in_flight=in_flight,
        in_flight_phase=status.in_flight_phase if in_flight else None,
        acked=status.acked if in_flight else [],
        waiting=status.waiting if in_flight else [],
        conflicts=[],
        running=running,
        adapters=adapters,
    )
