"""What a bus path names: an adapter in one of the fleet's object stores.

A request names an adapter pushed to the bus (:mod:`lorabus.adapters.store`)
by a *bus path*: ``bus:sha256:<hex>`` in the fleet's store,
``bus:<tenant>/sha256:<hex>`` in a tenant's. Each tenant pushes into a store
of its own (``Subjects.for_store``), bounded by its quota of bytes, where no
other tenant may write: the part of a bus path before the digest, its
*object key*, says which store holds it.

Pure functions: nothing here reads the bus.
"""

from __future__ import annotations

import re

from lorabus.schemas import check_tenant

__all__ = [
    "BUS_SCHEME",
    "bus_path",
    "check_digest",
    "digest_of",
    "is_digest",
    "key_of",
    "object_key",
    "split_key",
    "store_of",
]

BUS_SCHEME = "bus:"

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def is_digest(text: str) -> bool:
    """Whether ``text`` is an adapter digest (``sha256:<64 hex>``)."""
    return bool(_DIGEST.fullmatch(text))


def check_digest(digest: str) -> str:
    """``digest`` if it is an adapter digest (``sha256:<64 hex>``), else ValueError."""
    if not is_digest(digest):
        raise ValueError(f"{digest!r} is not an adapter digest: expected sha256:<64 hex digits>")
    return digest


def bus_path(digest: str, store: str = "") -> str:
    """The path that names the adapter of ``digest`` in the fleet's store, or
    in tenant ``store``'s."""
    return BUS_SCHEME + object_key(check_digest(digest), store)


def object_key(digest: str, store: str = "") -> str:
    """What names an object among every store of the fleet: its digest in the
    fleet's own store, ``<tenant>/<digest>`` in a tenant's."""
    return f"{check_tenant(store)}/{digest}" if store else digest


def split_key(key: str) -> tuple[str, str]:
    """An object key's store ("": the fleet's) and digest; ValueError for
    anything else."""
    store, sep, digest = key.rpartition("/")
    if sep:
        check_tenant(store)
    return store, check_digest(digest)


def key_of(path: str) -> str | None:
    """The object key a bus path names; None for a path on a filesystem.
    ValueError for a ``bus:`` path that names no valid object."""
    if not path.startswith(BUS_SCHEME):
        return None
    key = path.removeprefix(BUS_SCHEME)
    try:
        split_key(key)
    except ValueError:
        raise ValueError(
            f"{path!r} is not a valid bus path: expected {BUS_SCHEME}sha256:<64 hex digits>, "
            f"or {BUS_SCHEME}<tenant>/sha256:<64 hex digits>"
        ) from None
    return key


def digest_of(path: str) -> str | None:
    """The digest a bus path names; None for a path on a filesystem. ValueError
    for a ``bus:`` path that names no valid object."""
    key = key_of(path)
    return None if key is None else split_key(key)[1]


def store_of(path: str) -> str:
    """The tenant whose store a bus path names ("": the fleet's, or no bus path)."""
    key = key_of(path)
    return "" if key is None else split_key(key)[0]
