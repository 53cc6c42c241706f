"""The coordinator's settings, validated in one place.

The CLI's options, the process command lines the testbed builds and the
embedded stack all take their defaults from here.
"""

from __future__ import annotations

import msgspec

from lorabus.adapters.store import DEFAULT_STORE_MAX_BYTES
from lorabus.schemas import Naming, UpdateMode, check_token


class StorageConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Where a fleet keeps what must outlive its processes: the KV buckets and
    the audit stream (``lorabus provision`` sets them up with these)."""

    fleet: str
    subject_prefix: str = "lorabus"
    audit_max_age_s: float = 7 * 24 * 3600.0
    """How long the audit stream keeps records."""
    audit_max_bytes: int = 1 << 30
    """How large the audit stream may grow before dropping its oldest records."""
    kv_replicas: int = 1
    """Replicas of the fleet's KV buckets, object store and audit stream (3 on a
    three-node cluster)."""
    adapter_store_max_bytes: int = DEFAULT_STORE_MAX_BYTES
    """How large the fleet's adapter object store may grow: a push beyond it is
    refused (the store drops nothing on its own), and the fleet's buckets keep
    the rest of JetStream's storage. The server reserves it on its disk when
    the store is made. -1: as large as the server allows, which lets pushes
    take the room of the leader's lease and commit points: not advised."""
    tenants_file: str = ""
    """The fleet's tenants, each held to its adapters and quotas, with an
    adapter store of its own bounded by its ``max_bytes`` (``tenants.py``;
    ``lorabus auth init --tenant`` writes it). "": none."""

    def __post_init__(self) -> None:
        check_token("fleet", self.fleet)
        if self.audit_max_age_s < 60:
            raise ValueError(f"audit max age must be >= 60s, got {self.audit_max_age_s}")
        if self.audit_max_bytes < 1 << 20:
            raise ValueError(f"audit max bytes must be >= 1 MiB, got {self.audit_max_bytes}")
        if self.adapter_store_max_bytes != -1 and self.adapter_store_max_bytes < 1 << 20:
            raise ValueError(
                "adapter store max bytes must be -1 (no limit) or >= 1 MiB, "
                f"got {self.adapter_store_max_bytes}"
            )
        if not 1 <= self.kv_replicas <= 5:
            raise ValueError("kv replicas must be 1 to 5")


class CoordinatorConfig(StorageConfig, frozen=True, kw_only=True):
    frontend_url: str
    expected_world_size: int
    phase_timeout_s: float = 30.0
    """Deadline for all members to ack one phase (pause, load, resume, unload);
    a load the pause carries has twice this, counted from the pause."""
    verify_timeout_s: float = 60.0
    """Deadline for the frontend to list the new adapter."""
    prepare_timeout_s: float = 300.0
    """Deadline for all members to fetch an adapter from the fleet's object
    store (``bus:`` paths), before anything is paused."""
    quorum_timeout_s: float = 30.0
    """Deadline for live agents' world sizes to reach the expected sum."""
    nodes_file: str = ""
    """Which workers each node agent may ack and beat for (``lorabus auth
    init --node`` writes it). "": a node's messages count for whatever
    workers they name, as on a bus without permissions."""
    canary: bool = True
    """After the load (live mode) or the resume (pause mode), every member's
    engine and the frontend generate one token with the new served name
    before the update commits (``canary.py``); False turns it off."""
    keep: int = 2
    """Versions of an adapter kept loaded after its commit, the committed one
    among them (versioned naming), unless the request says (``keep``)."""
    orphan_after_s: float = 3600.0
    """An object of the adapter store that no commit keeps and no queued
    request names is deleted at a commit once it is older than this."""
    replace_after_s: float = 30.0
    """A placed worker silent this long is replaced by another (``replacement.py``)."""
    naming: Naming = Naming.VERSIONED
    mode: UpdateMode = UpdateMode.PAUSE
    """How an update runs unless its request says: ``pause`` (the fleet pauses
    around the load) or ``live`` (nothing pauses; needs versioned naming)."""
    headers: dict[str, str] = {}
    """Sent with every frontend call (auth)."""
    http_timeout_s: float = 10.0
    adapter_roots: list[str] = []
    """If set, adapter paths must lie under one of these directories."""
    pause_lease_s: float = 30.0
    """An agent resumes on its own when a pause is neither renewed nor ended in this."""
    leader_lease_s: float = 5.0
    """A standby takes over after the leader record stays unrenewed this long."""
    holder: str = ""
    """This coordinator's name in the leader record; default: host and pid."""
    quorum: float = 1.0
    """Share of the expected world size an update needs: 1.0 is all; below, members
    that fail or do not ack are left out of the commit and its rank map."""
    quorum_grace_s: float = 2.0
    """With a quorum below all: how long to wait for the full membership first."""
    signing_key_file: str = ""
    """An nkey seed file: sign every command with it and name its public key in
    the leader record ("": commands go unsigned)."""
    max_queued: int = 16
    """Update requests of one adapter that may wait; more are answered ``busy``."""
    max_queued_total: int = 256
    """Update requests that may wait in all, of every adapter; more are answered ``busy``."""
    max_concurrent: int = 16
    """Updates of different adapters that may run at once (pause-mode ones
    in rounds that share one pause of the fleet, ``book.py``)."""
    min_heartbeat_s: float = 0.05
    max_heartbeat_s: float = 60.0
    """Heartbeat periods outside this range are dropped as bad messages: a huge
    one would keep a vanished member live for ever."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.expected_world_size < 1:
            raise ValueError("expected world size must be >= 1")
        for name in (
            "phase_timeout_s",
            "verify_timeout_s",
            "prepare_timeout_s",
            "quorum_timeout_s",
            "http_timeout_s",
            "pause_lease_s",
            "leader_lease_s",
            "replace_after_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name.removesuffix('_s').replace('_', ' ')} must be > 0")
        if not 0 < self.quorum <= 1:
            raise ValueError(f"quorum must be 'all' or a fraction in (0, 1], got {self.quorum}")
        for name in ("max_queued", "max_queued_total", "max_concurrent"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be >= 1")
        if not 0 < self.min_heartbeat_s <= self.max_heartbeat_s:
            raise ValueError("heartbeat range must satisfy 0 < min <= max")
        if self.mode is UpdateMode.LIVE and self.naming is not Naming.VERSIONED:
            raise ValueError(
                "live mode needs versioned naming: a fixed name cannot be "
                "replaced while engines serve it"
            )
        if self.orphan_after_s < 0:
            raise ValueError(f"orphan after must be >= 0 seconds, got {self.orphan_after_s}")
        if self.keep < 1:
            raise ValueError("keep must be >= 1: the committed version is always kept")
        if not self.frontend_url.startswith(("http://", "https://")):
            raise ValueError(
                f"frontend URL {self.frontend_url!r} must start with http:// or https://"
            )
