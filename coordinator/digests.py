"""Do the members of an update see the same adapter bytes?

Each agent hashes the directory at the update's path on its own host before
loading it and puts the digest in its load ack. A shared filesystem that is
stale or half-synced on one host shows there as another digest, and an update
whose members would serve different bytes under one name must not commit.
"""

from __future__ import annotations

from collections.abc import Mapping

from lorabus.schemas import Ack, ErrorCode, ErrorInfo


def digest_problem(asked: str | None, acks: Mapping[str, Ack]) -> ErrorInfo | None:
    """Why the load acks ``acks`` must not commit, or None. With a requested digest
    ``asked``: any member that saw other bytes (the agent refused the load) or
    could not read them; without one: ok members whose digests differ (an agent
    that could not read the directory reports none and is not counted)."""
    refused = {
        wid: ack
        for wid, ack in acks.items()
        if ack.error is not None and ack.error.code == ErrorCode.DIGEST_MISMATCH
    }
    if asked is not None:
        wrong = {
            wid: ack.digest or "unreadable"
            for wid, ack in acks.items()
            if wid in refused or (ack.ok and ack.digest != asked)
        }
        if not wrong:
            return None
        return ErrorInfo(
            code=ErrorCode.DIGEST_MISMATCH,
            message=f"the request's digest is {asked}, but "
            + _listed(wrong)
            + " at the adapter path: refusing to commit bytes that differ between replicas",
        )
    seen: dict[str, list[str]] = {}
    for wid, ack in sorted(acks.items()):
        if ack.ok and ack.digest:
            seen.setdefault(ack.digest, []).append(wid)
    if len(seen) <= 1:
        return None
    groups = "; ".join(f"{', '.join(wids)} see {digest}" for digest, wids in sorted(seen.items()))
    return ErrorInfo(
        code=ErrorCode.DIGEST_MISMATCH,
        message=f"members see different bytes at the adapter path ({groups}): "
        "refusing to commit bytes that differ between replicas",
    )


def agreed_digest(asked: str | None, acks: Mapping[str, Ack], serving: list[str]) -> str:
    """The digest the serving members saw ("" when none could read the directory)."""
    if asked is not None:
        return asked
    return next((acks[w].digest for w in serving if w in acks and acks[w].digest), "")


def _listed(wrong: Mapping[str, str]) -> str:
    shown = [f"{wid} sees {digest}" for wid, digest in sorted(wrong.items())[:10]]
    more = f" (and {len(wrong) - 10} more)" if len(wrong) > 10 else ""
    return ", ".join(shown) + more
