"""What a load from a path hands the engine, checked on this host.

The path is checked against the agent's adapter roots
(:func:`~lorabus.agents.adapter_paths.resolve_adapter_dir`; ``path_refused``
otherwise) and the engine is handed the resolved one; the bytes there are
hashed, for the ack and against the digest the request asked for
(``digest_mismatch`` otherwise). Loads from the fleet's object store take
neither: their bytes were verified when they were fetched into the cache.
"""

from __future__ import annotations

import asyncio
import logging

from lorabus.adapters.digest import read_adapter_digest
from lorabus.agents.adapter_paths import resolve_adapter_dir
from lorabus.errors import DigestMismatch, LorabusError
from lorabus.schemas import ErrorCode, ErrorInfo

log = logging.getLogger(__name__)


async def checked_dir(path: str, roots: list[str], worker_id: str, update_id: str) -> str:
    """The path to hand the engine, checked on this host against ``roots``."""
    try:
        if roots:
            # realpath and stat can block on a network filesystem: off the
            # loop, and under the command's budget like any engine call.
            real = await asyncio.to_thread(resolve_adapter_dir, path, roots)
        else:
            real = resolve_adapter_dir(path, ())  # no roots: reads nothing from disk
    except ValueError as exc:
        refusal = ErrorInfo(
            code=ErrorCode.PATH_REFUSED, message=f"{worker_id} refused the load: {exc}"
        )
        raise LorabusError.from_info(refusal) from exc
    if real != path:
        log.info(
            "worker=%s update=%s adapter path %s resolves to %s", worker_id, update_id, path, real
        )
    return real


async def seen_digest(path: str, asked: str | None, worker_id: str) -> str:
    """The digest of what this host shows at ``path`` (for the ack). An agent
    that cannot read the directory (the engine's files are not mounted here)
    says so with an empty digest, which passes only when no digest was asked
    for (DigestMismatch otherwise)."""
    try:
        # Reads every file (in a thread, shared with agents of this process
        # reading it at the same moment), under the command's budget.
        seen = await read_adapter_digest(path)
    except (OSError, ValueError) as exc:
        if asked is not None:
            raise DigestMismatch(f"{worker_id} cannot check the digest of {path}: {exc}") from exc
        log.debug("worker=%s no digest of %s: %s", worker_id, path, exc)
        return ""
    return seen


def refuse_other_bytes(seen: str, asked: str | None, path: str, worker_id: str) -> None:
    """Refuse the load when what this host shows is not what was asked for."""
    if asked is not None and seen != asked:
        raise DigestMismatch(f"{worker_id} sees {seen} at {path}, not the requested {asked}")
