"""A fleet's tenants as its tenants file holds them (``lorabus auth init
--tenant`` writes it, the coordinator reads it: ``coordinator/tenants.py``)::

    {"team-a": {"adapters": "team-a-*", "max_queued": 4, "max_adapters": 8, "max_keep": 4,
                "max_bytes": 1073741824}}
"""

from __future__ import annotations

import fnmatch
import posixpath

import msgspec

from lorabus.schemas.bounds import MAX_KEEP
from lorabus.schemas.subjects import check_tenant

TENANTS_ENV = "LORABUS_TENANTS_FILE"
"""Where a coordinator finds its tenants file when ``--tenants`` is not given
(``lorabus auth init --tenant`` writes it into the coordinator's identity)."""

TENANT_ENV = "LORABUS_TENANT"
"""The tenant a ``lorabus`` command asks as (``--tenant``): in a tenant
identity's ``lorabus.env``."""

ID_SEPARATOR = ":"
"""A tenant's update ids begin with its name and this, which no name holds."""


class Tenant(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One tenant's record in the tenants file."""

    adapters: str
    """The adapter names it owns: a shell-style pattern (``team-a-*``)."""
    max_queued: int = 4
    """Its update requests that may wait at once."""
    max_adapters: int = 8
    """Adapters it may have, committed, queued or running."""
    max_keep: int = 4
    """Versions of one adapter a request of its may ask to keep."""
    max_bytes: int = 1 << 30
    """The most bytes of adapters it may keep pushed: the size of its own
    adapter store, which refuses a push beyond it (the server reserves it
    when the store is made)."""
    roots: list[str] = []
    """Directories on the workers its adapters may be loaded from (none: only
    from the fleet's store, ``bus:<digest>``). The check is of the path's
    text: give a tenant a root only where no other tenant's files are
    reachable through a link it can make."""

    def __post_init__(self) -> None:
        if not self.adapters or len(self.adapters) > 256:
            raise ValueError("a tenant's adapter pattern must be 1-256 characters")
        for field in ("max_queued", "max_adapters"):
            if getattr(self, field) < 1:
                raise ValueError(f"a tenant's {field} must be >= 1")
        if self.max_bytes < 1 << 20:
            raise ValueError("a tenant's max_bytes must be at least 1 MiB")
        if not 1 <= self.max_keep <= MAX_KEEP:
            raise ValueError(f"a tenant's max_keep must be 1-{MAX_KEEP}")
        for root in self.roots:
            if not posixpath.isabs(root) or not posixpath.normpath(root).strip("/"):
                raise ValueError(f"a tenant's root must be an absolute directory, not {root!r}")

    def owns(self, adapter: str) -> bool:
        return fnmatch.fnmatchcase(adapter, self.adapters)

    def may_load(self, path: str) -> bool:
        """Whether ``path``, a directory on the workers, lies under one of its roots."""
        if "\0" in path or not posixpath.isabs(path):
            return False
        normal = posixpath.normpath(path)
        return any(
            normal.startswith(posixpath.normpath(root).rstrip("/") + "/") for root in self.roots
        )


def decode_tenants(raw: bytes) -> dict[str, Tenant]:
    """A tenants file's content; ValueError (msgspec's) for anything else."""
    tenants = msgspec.json.decode(raw, type=dict[str, Tenant])
    for name in tenants:
        check_tenant(name)
    return tenants


def encode_tenants(tenants: dict[str, Tenant]) -> bytes:
    return msgspec.json.format(msgspec.json.encode(tenants), indent=2) + b"\n"


def parse_tenant(spec: str) -> tuple[str, Tenant]:
    """``NAME=PATTERN`` (``lorabus auth init --tenant``) as a name and a record."""
    name, sep, pattern = spec.partition("=")
    if not sep:
        raise ValueError(f"tenant {spec!r} is not NAME=PATTERN")
    return check_tenant(name), Tenant(adapters=pattern)
