"""The fleet's durable state in JetStream KV, written by the active coordinator.

A successor reads them to take over (the leader record, what is committed,
the update in flight); agents read the leader and committed records to
converge on the committed state. Sealed when the coordinator signs
(:mod:`lorabus.security.signing`).
"""

from __future__ import annotations

import msgspec

from lorabus.schemas.bounds import Epoch, Name, SeenDigest, Text, Version
from lorabus.schemas.rankmap import RankMap
from lorabus.schemas.wire import Phase


class LeaderRecord(msgspec.Struct, frozen=True, kw_only=True):
    holder: str
    epoch: Epoch
    signing_key: str = ""
    """The public key this leader signs its commands with ("": it does not sign)."""


class KeptVersion(msgspec.Struct, frozen=True, kw_only=True):
    """An earlier committed version of an adapter that engines keep serving
    beside the committed one, and the fleet's object store keeps (``path``
    a ``bus:`` path) or a shared filesystem holds."""

    version: Version
    served_name: Name = ""
    """("": written by a version-6 coordinator, which kept only the object
    store's versions, by ``digest``: engines are not asked to serve it.)"""
    path: Text = ""
    """("": likewise; its object is ``bus:<digest>``.)"""
    digest: SeenDigest = ""
    """The content digest the members saw when it was committed (for a
    version-6 record, the object's in the fleet's store)."""


class CommittedRecord(msgspec.Struct, frozen=True, kw_only=True):
    adapter: str
    version: Version
    path: str
    served_name: str
    rank_map: RankMap
    lineage: Epoch = 0
    """The adapter's lineage when this was committed (see ``ResetRequest``)."""
    digest: str = ""
    """The content digest the members saw (see ``UpdateResult.digest``)."""
    kept: list[KeptVersion] = []
    """The adapter's earlier versions kept beside this one (with it, its
    ``keep`` newest commits), newest first: what every engine serves for the
    adapter besides it (agents converge on it), and, for those from the
    object store, what the store must hold (coordinator/adapter_store.py)."""
    dropped: list[str] = []
    """The keys of the objects this commit let go of (fallen out of ``kept``:
    a digest, or ``<tenant>/<digest>`` in a tenant's store):
    deleted once it is written, unless something else still names them."""
    committed_at: float = 0.0
    """When it was committed (Unix time, the leader's clock; 0: not said)."""
    workers: list[str] = []
    """The workers placed to serve it and the versions kept beside it
    ([]: every worker): the agents of the others do not load them."""
    selector: dict[str, str] = {}
    """The labels its update asked its workers to have: a worker that
    leaves is replaced by one that has them too."""


class ResetRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The latest reset of an adapter's committed state: its lineage outlives
    the committed record it removed, for the next commit and a successor."""

    adapter: str
    lineage: Epoch
    previous_version: Version
    previous_path: str
    reason: str
    ts: float
    kept: list[KeptVersion] = []
    """The versions the removed commit kept (itself first): still kept in the
    object store, until the adapter's next commit keeps them beside it."""


class InflightRecord(msgspec.Struct, frozen=True, kw_only=True):
    update_id: str
    epoch: Epoch
    phase: Phase
    adapter: str
    served_name: str
    version: Version
    members: dict[str, int]
    """The membership snapshot: everyone here may have been told to pause."""
    path: str = ""
    """The adapter directory, for the result a successor records."""
    committing: CommittedRecord | None = None
    """Set, by compare-and-set on the record it sent, by the term that ran the
    update once it may commit, ahead of its commit point: a successor finishes
    this commit and never rolls it back."""
    taken_over_by: Epoch = 0
    """Set, by compare-and-set, by a successor before it rolls the update back:
    from then on the term that ran it cannot claim its commit (a term that was
    frozen past its lease and woke up with every ack in hand)."""
