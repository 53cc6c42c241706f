"""The fleet's durable state in JetStream KV, written by the active coordinator.

A successor reads them to take over (the leader record, what is committed,
the update in flight); agents read the leader and committed records to
converge on the committed state. Sealed when the coordinator signs
(:mod:`lorabus.security.signing`).
"""

from __future__ import annotations

import msgspec

from lorabus.schemas.bounds import Epoch, Version
from lorabus.schemas.rankmap import RankMap
from lorabus.schemas.wire import Phase


class LeaderRecord(msgspec.Struct, frozen=True, kw_only=True):
    holder: str
    epoch: Epoch
    signing_key: str = ""
    """The public key this leader signs its commands with ("": it does not sign)."""


class StoredVersion(msgspec.Struct, frozen=True, kw_only=True):
    """A committed version of an adapter whose bytes are in the fleet's object store."""

    version: Version
    digest: str


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
    kept: list[StoredVersion] = []
    """The adapter's earlier versions from the fleet's object store kept beside
    this one (its ``keep`` newest commits), newest first: with the committed
    one, what the store must hold for the adapter (coordinator/adapter_store.py)."""
    dropped: list[str] = []
    """The object store digests this commit let go of (fallen out of ``kept``):
    deleted once it is written, unless something else still names them."""


class ResetRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The latest reset of an adapter's committed state: its lineage outlives
    the committed record it removed, for the next commit and a successor."""

    adapter: str
    lineage: Epoch
    previous_version: Version
    previous_path: str
    reason: str
    ts: float
    kept: list[StoredVersion] = []
    """The versions from the object store that the removed commit kept (itself
    first): still kept, until the adapter's next commit keeps them beside it."""


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
