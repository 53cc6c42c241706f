"""Reading an adapter out of the store, as agents do: JetStream direct gets only.

An agent reads an object with direct gets alone: the meta by its subject,
then its chunks by subject and sequence, a batch at a time. A consumer would
need more rights, and its deliver subject would let an agent aim JetStream
(docs/security.md). What an agent fetches is unpacked as it arrives and
checked against the adapter digest by the agent's cache
(lorabus.agents.adapter_cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Protocol

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import ObjectInfo

from lorabus.adapters.archive import BadArchive
from lorabus.adapters.bus_paths import check_digest
from lorabus.adapters.store_layout import (
    READ_DEADLINE_S,
    chunk_subject,
    is_pushed,
    meta_subject,
    read_meta_at,
    status_description,
    stream_name,
)
from lorabus.bus.connect import js_api_of
from lorabus.errors import BusError, FetchFailed
from lorabus.schemas import Subjects

__all__ = ["ChunkSink", "fetch_object"]

log = logging.getLogger(__name__)

_BATCH_TRIES = 6
_BATCH_RETRY_GAP_S = 0.5
"""Before asking again, times the try: a node's death takes a reconnect."""
_BATCH_BYTES = 4 << 20
"""How many bytes of chunks one batch of direct gets asks for: eight chunks, a
round trip per batch instead of per chunk (which a real network makes
dearer); a batch is what sits in memory, whatever the adapter's size."""


class ChunkSink(Protocol):
    """Where a fetch writes an object's bytes, in order, from a thread: an
    agent's :class:`~lorabus.adapters.archive.Unpacker`, which unpacks them
    as they come."""

    def write(self, data: bytes, /) -> int: ...


async def fetch_object(
    nc: NatsClient,
    subjects: Subjects,
    digest: str,
    into: ChunkSink,
    *,
    timeout_s: float,
    max_bytes: int,
) -> int:
    """Write the object stored under ``digest`` into ``into``; returns its size.
    FetchFailed, naming the digest and why, for whatever goes wrong: the
    store, the stored records, or ``into`` refusing what it is given."""
    check_digest(digest)
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            found = await read_meta_at(nc, subjects, meta_subject(subjects, digest))
            if found is None:
                raise FetchFailed(f"adapter {digest} is not in the fleet's store (or deleted)")
            info = found[0]
            _checked(info, digest, max_bytes)
            return await _read_chunks(nc, subjects, info, into)
    except FetchFailed:
        raise
    except TimeoutError as exc:
        if deadline.expired():
            raise FetchFailed(f"adapter {digest}: not fetched within {timeout_s:g}s") from exc
        raise FetchFailed(f"adapter {digest}: the store stopped answering mid-transfer") from exc
    except BadArchive as exc:
        raise FetchFailed(f"adapter {digest}: the store's object is no adapter: {exc}") from exc
    except (BusError, nats.errors.Error, OSError, ValueError) as exc:
        raise FetchFailed(f"adapter {digest}: {exc}") from exc


def _checked(info: ObjectInfo, digest: str, max_bytes: int) -> None:
    """Raise FetchFailed unless the meta is one we can read safely. nats' own
    SHA-256 of the object is not checked: the adapter digest of what is
    unpacked is (agents/adapter_cache.py), and a second hash of every byte
    cost a fetch a third of its time."""
    if not is_pushed(info, digest):
        raise FetchFailed(f"adapter {digest}: the stored meta is not one of a pushed adapter")
    if int(info.size or 0) > max_bytes:
        raise FetchFailed(f"adapter {digest} is {info.size} bytes, over the limit of {max_bytes}")


async def _read_chunks(
    nc: NatsClient, subjects: Subjects, info: ObjectInfo, into: ChunkSink
) -> int:
    """Read the object's chunks in order, a batch of direct gets at a time.
    Only chunk ``i`` is taken as the ``i``-th: a chunk stored past the last
    one (on a subject of its own, since none can be written twice) is no
    part of the object."""
    digest, size, count = info.name, int(info.size or 0), int(info.chunks or 0)
    nuid = str(info.nuid)
    seq, read, total = 1, 0, 0
    wildcard = chunk_subject(subjects, digest, nuid, "*")
    while read < count:
        batch = await _batch_again(nc, subjects, {"seq": seq, "next_by_subj": wildcard})
        if not batch:
            raise FetchFailed(f"adapter {digest} is short: {read} of {count} chunks stored")
        for msg in batch:
            headers = msg.headers or {}
            seq = int(headers.get("Nats-Sequence", "")) + 1
            if read == count or headers.get("Nats-Subject") != chunk_subject(
                subjects, digest, nuid, read
            ):
                continue  # not the next chunk: stored after the object, or out of order
            total += len(msg.data)
            read += 1
            if total > size:
                raise FetchFailed(f"adapter {digest}: its chunks hold more than its {size} bytes")
            # In a thread: unpacking writes files, which can block.
            await asyncio.to_thread(into.write, msg.data)
    if total != size:
        raise FetchFailed(f"adapter {digest} is short: {total} of {size} bytes stored")
    return total


async def _batch_again(nc: NatsClient, subjects: Subjects, start: dict[str, object]) -> list[Msg]:
    """:func:`_batch`, asked again from the same place when it breaks off: a
    NATS node that dies mid-batch takes the rest of the batch and its end
    with it, while the connection moves to another node that has the same
    chunks (the store is replicated as the KV buckets are). Nothing of a
    broken batch was written, so asking from the same sequence loses nothing
    and repeats nothing. The caller's deadline bounds the whole."""
    for attempt in range(1, _BATCH_TRIES + 1):
        try:
            return await _batch(nc, subjects, start)
        except (TimeoutError, nats.errors.Error) as exc:
            if attempt == _BATCH_TRIES and isinstance(exc, nats.errors.NoRespondersError):
                # The object's meta was read from this store a moment ago.
                raise BusError(
                    f"no replica of adapter store {subjects.adapter_store()!r} answered "
                    "a direct get: is a NATS node of its stream down?"
                ) from exc
            if attempt == _BATCH_TRIES:
                raise
            await asyncio.sleep(_BATCH_RETRY_GAP_S * attempt)
            log.info("adapter store: a batch broke off (%r); asking again from %s", exc, start)
    raise AssertionError("unreachable")


async def _batch(nc: NatsClient, subjects: Subjects, start: dict[str, object]) -> list[Msg]:
    """Up to ``_BATCH_BYTES`` of stored messages from ``start`` on (none: no more)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        request = {**start, "batch": 1024, "max_bytes": _BATCH_BYTES}
        await nc.publish(
            f"{js_api_of(nc)}.DIRECT.GET.{stream_name(subjects)}",
            json.dumps(request).encode(),
            reply=inbox,
        )
        found: list[Msg] = []
        while True:
            msg = await sub.next_msg(timeout=READ_DEADLINE_S)
            status = (msg.headers or {}).get("Status", "")
            if not status:
                found.append(msg)
            elif status in ("204", "404"):  # the batch's end; nothing (more) stored
                return found
            elif status == "503":  # no replica answers yet: asked again, as a dead node is
                raise nats.errors.NoRespondersError
            else:
                raise BusError(f"reading the adapter store: {status} {status_description(msg)}")
    finally:
        with contextlib.suppress(Exception):  # a connection gone: nothing to undo
            await sub.unsubscribe()
