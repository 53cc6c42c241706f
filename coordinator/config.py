"""The coordinator's settings, validated in one place."""

from __future__ import annotations

import msgspec

from schemas import Naming


class CoordinatorConfig(msgspec.Struct, frozen=True, kw_only=True):
    fleet: str
    frontend_url: str
    expected_world_size: int
    phase_timeout_s: float = 30.0
    """Deadline for all members to ack one phase (pause, load, resume, unload)."""
    verify_timeout_s: float = 60.0
    """Deadline for the frontend to list the new adapter."""
    quorum_timeout_s: float = 30.0
    """Deadline for live agents' world sizes to reach the expected sum."""
    keep: int = 2
    """Versions of an adapter kept loaded after a commit (versioned naming)."""
    naming: Naming = Naming.VERSIONED
    headers: dict[str, str] = {}
    """Sent with every frontend call (auth)."""
    http_timeout_s: float = 10.0
    adapter_roots: list[str] = []
    """If set, adapter paths must lie under one of these directories."""
    subject_prefix: str = "lorabus"

    def __post_init__(self) -> None:
        if self.expected_world_size < 1:
            raise ValueError("expected world size must be >= 1")
        for name in ("phase_timeout_s", "verify_timeout_s", "quorum_timeout_s", "http_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name.removesuffix('_s').replace('_', ' ')} must be > 0")
        if self.keep < 1:
            raise ValueError("keep must be >= 1: the committed version is always kept")
        if not self.frontend_url.startswith(("http://", "https://")):
            raise ValueError(
                f"frontend URL {self.frontend_url!r} must start with http:// or https://"
            )
