"""Adapters carried by the bus: a JetStream object store of the fleet, keyed by
the adapter's content digest, instead of a filesystem every host must mount.

The trainer side packs an adapter directory as a plain tar whose bytes depend
only on the files (sorted paths, fixed headers) and puts it under its digest;
a digest already stored is not sent again. Agents read an object with
JetStream direct gets only: the meta by its subject, then its chunks by
subject and sequence. A consumer would need more rights, and its deliver
subject would let an agent aim JetStream (docs/security.md). What an agent
fetches is unpacked as it arrives and checked against the adapter digest by
the agent's cache (lorabus.agents.adapter_cache).
A request names such an adapter by a *bus path*: ``bus:sha256:<hex>``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import os
import re
import tempfile
import time
from datetime import datetime
from typing import BinaryIO, Protocol

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import object_store as obj
from nats.js.api import (
    DiscardPolicy,
    ObjectInfo,
    ObjectMeta,
    ObjectMetaOptions,
    StorageType,
    StreamConfig,
)

from lorabus.adapter_archive import check_adapter_dir, pack
from lorabus.adapter_digest import adapter_digest
from lorabus.bus import js_api_of
from lorabus.errors import BadRequest, BusError, FetchFailed
from lorabus.schemas import Subjects

__all__ = [
    "BUS_SCHEME",
    "ChunkSink",
    "bus_path",
    "check_digest",
    "delete_object",
    "digest_of",
    "fetch_object",
    "object_size",
    "push_adapter",
    "store_config",
    "stored_objects",
]

BUS_SCHEME = "bus:"


class ChunkSink(Protocol):
    """Where a fetch writes an object's bytes, in order (a file, a pipe)."""

    def write(self, data: bytes, /) -> int: ...


_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_NUID = re.compile(r"^[A-Za-z0-9]{1,64}$")
log = logging.getLogger(__name__)

_READ_DEADLINE_S = 5.0
"""How long one read of the store (a meta, the next chunk of a batch) may take."""
_STAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)")
"""JetStream's time stamps: RFC 3339 with up to nanoseconds."""
_NO_RESPONDERS_PAUSES_S = (0.1, 0.2, 0.4, 0.8, 1.0)
"""Pauses before asking a direct get again that nobody answered: in a
cluster, only a stream's current replicas answer them, and after a node
restarts there can be a moment with none (seen: an update refused as if the
store were missing). A store that is really missing is said after 2.5 s."""
_BATCH_TRIES = 6
_BATCH_RETRY_GAP_S = 0.5
"""Before asking again, times the try: a node's death takes a reconnect."""
_CHUNK_BYTES = 512 << 10
"""Four times nats-py's default chunk: on a 2-core machine, server on the same
host, a 128 MB fetch took 0.57 s in 128 KiB chunks and 1 MiB batches, 0.40 s
in 512 KiB chunks and 4 MiB batches (and its push 0.95 s, then 0.69 s)."""
_BATCH_BYTES = 4 << 20
"""How many bytes of chunks one batch of direct gets asks for: eight chunks, a
round trip per batch instead of per chunk (which a real network makes
dearer); a batch is what sits in memory, whatever the adapter's size."""
_PURGE_GRACE_S = 15.0
"""Beyond a push's deadline, for nats-py to purge the chunks of an upload it stopped."""


def check_digest(digest: str) -> str:
    """``digest`` if it is an adapter digest (``sha256:<64 hex>``), else ValueError."""
    if not _DIGEST.fullmatch(digest):
        raise ValueError(f"{digest!r} is not an adapter digest: expected sha256:<64 hex digits>")
    return digest


def bus_path(digest: str) -> str:
    """The path that names the adapter of ``digest`` in the fleet's store."""
    return BUS_SCHEME + check_digest(digest)


def digest_of(path: str) -> str | None:
    """The digest a bus path names; None for a path on a filesystem. ValueError
    for a ``bus:`` path that names no valid digest."""
    if not path.startswith(BUS_SCHEME):
        return None
    try:
        return check_digest(path.removeprefix(BUS_SCHEME))
    except ValueError:
        raise ValueError(
            f"{path!r} is not a valid bus path: expected {BUS_SCHEME}sha256:<64 hex digits>"
        ) from None


def store_config(subjects: Subjects, *, replicas: int = 1, max_bytes: int = -1) -> StreamConfig:
    """The stream of the fleet's adapter store: as ``js.create_object_store``
    makes one, file-backed, with direct gets (agents read nothing else)."""
    bucket = subjects.adapter_store()
    return StreamConfig(
        name=obj.OBJ_STREAM_TEMPLATE.format(bucket=bucket),
        subjects=[
            obj.OBJ_ALL_CHUNKS_PRE_TEMPLATE.format(bucket=bucket),
            obj.OBJ_ALL_META_PRE_TEMPLATE.format(bucket=bucket),
        ],
        max_bytes=max_bytes,
        max_consumers=0,
        storage=StorageType.FILE,
        num_replicas=replicas,
        discard=DiscardPolicy.NEW,
        allow_rollup_hdrs=True,
        allow_direct=True,
    )


def _no_store(subjects: Subjects) -> BusError:
    return BusError(
        f"fleet {subjects.fleet!r} has no adapter store {subjects.adapter_store()!r} "
        "readable with direct gets: run lorabus provision (as the operator)"
    )


async def _store(nc: NatsClient, subjects: Subjects) -> obj.ObjectStore:
    try:
        return await nc.jetstream().object_store(subjects.adapter_store())
    except nats.js.errors.BucketNotFoundError as exc:
        raise _no_store(subjects) from exc


async def _read_meta(nc: NatsClient, subjects: Subjects, digest: str) -> ObjectInfo | None:
    """The stored object's info (None: none, or deleted), by one direct get."""
    bucket = subjects.adapter_store()
    name = base64.urlsafe_b64encode(digest.encode()).decode()  # as nats-py names it
    meta = obj.OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=name)
    found = await _read_meta_at(nc, subjects, meta)
    return None if found is None else found[0]


async def _read_meta_at(
    nc: NatsClient, subjects: Subjects, meta: str
) -> tuple[ObjectInfo, str] | None:
    """The info stored on meta subject ``meta`` and the server's time stamp of
    it, as sent; None: none, or deleted."""
    stream = obj.OBJ_STREAM_TEMPLATE.format(bucket=subjects.adapter_store())
    subject = f"{js_api_of(nc)}.DIRECT.GET.{stream}.{meta}"
    for pause in (*_NO_RESPONDERS_PAUSES_S, None):
        try:
            msg = await nc.request(subject, b"", timeout=_READ_DEADLINE_S)
            break
        except nats.errors.NoRespondersError as exc:
            if pause is None:
                raise _no_store(subjects) from exc
            await asyncio.sleep(pause)
    status = (msg.headers or {}).get("Status", "")
    if status == "404":
        return None
    if status:
        raise BusError(f"reading the adapter store: {status} {_description(msg)}")
    try:
        info = ObjectInfo.from_response(json.loads(msg.data))
    except (ValueError, TypeError, AttributeError) as exc:
        raise BusError(f"the stored meta on {meta} is not valid: {exc}") from exc
    return None if info.deleted else (info, (msg.headers or {}).get("Nats-Time-Stamp", ""))


def _server_time(stamp: str) -> float:
    """A JetStream time stamp (RFC 3339, nanoseconds) in seconds since the epoch."""
    found = _STAMP.fullmatch(stamp)
    if found is None:
        raise ValueError(f"not a time stamp: {stamp!r}")
    whole, fraction, zone = found.groups()
    at = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone)).timestamp()
    return at + float(f"0{fraction}" if fraction else 0)


async def stored_objects(
    nc: NatsClient, subjects: Subjects, *, timeout_s: float = 30.0
) -> dict[str, float]:
    """Every object the store holds, by digest, with when it was stored: the
    meta subjects from the stream's info, then each meta by one direct get
    (the reads an agent may make too: no consumer)."""
    bucket = subjects.adapter_store()
    stream = obj.OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    try:
        async with asyncio.timeout(timeout_s):
            info = await nc.jetstream().stream_info(stream, subjects_filter=f"$O.{bucket}.M.>")
            stored: dict[str, float] = {}
            for meta in sorted(info.state.subjects or {}):
                found = await _read_meta_at(nc, subjects, meta)
                # Only what a push stores: anything else put there by hand
                # is no adapter of lorabus's, to list or to delete.
                if found is None or not _DIGEST.fullmatch(found[0].name or ""):
                    continue
                try:
                    stored[found[0].name] = _server_time(found[1])
                except ValueError:  # undated: never old enough to sweep
                    log.warning("adapter store: %s has no time stamp: %r", meta, found[1][:64])
            return stored
    except nats.js.errors.NotFoundError as exc:
        raise _no_store(subjects) from exc
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"listing the adapter store failed: {exc!r}") from exc


async def object_size(
    nc: NatsClient, subjects: Subjects, digest: str, *, timeout_s: float = 5.0
) -> int | None:
    """The size of the object stored under ``digest``; None when there is none.
    BusError when the store cannot be read."""
    try:
        async with asyncio.timeout(timeout_s):
            info = await _read_meta(nc, subjects, check_digest(digest))
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot read the adapter store: {exc!r}") from exc
    return None if info is None else int(info.size or 0)


class _UntilDeadline(io.BufferedIOBase):
    """A file that fails to read past a deadline: nats-py purges the chunks of
    an upload that fails, not of one that is cancelled, so a push stops this way."""

    def __init__(self, file: BinaryIO, deadline: float) -> None:
        self._file, self._deadline = file, deadline

    def readinto(self, buffer: bytearray) -> int:  # type: ignore[override]
        if time.monotonic() > self._deadline:
            raise TimeoutError("the push took longer than its deadline")
        return self._file.readinto(buffer)  # type: ignore[attr-defined]


async def push_adapter(
    nc: NatsClient, subjects: Subjects, directory: str | os.PathLike[str], *, timeout_s: float = 600
) -> tuple[str, bool]:
    """Put the adapter in ``directory`` into the fleet's store under its digest;
    returns the digest and whether it was uploaded (False: already stored)."""
    try:
        check_adapter_dir(directory)
    except (ValueError, OSError) as exc:
        raise BadRequest(f"cannot push {directory!r}: {exc}") from exc
    deadline = time.monotonic() + timeout_s
    try:
        async with asyncio.timeout(timeout_s + _PURGE_GRACE_S):
            try:
                digest = await asyncio.to_thread(adapter_digest, directory)
            except (ValueError, OSError) as exc:
                raise BadRequest(f"cannot push {directory!r}: {exc}") from exc
            store = await _store(nc, subjects)
            if await _read_meta(nc, subjects, digest) is not None:
                return digest, False
            # On disk, not in memory: an adapter can be many GB.
            with tempfile.TemporaryFile() as archive:
                await asyncio.to_thread(pack, directory, archive)
                archive.seek(0)
                meta = ObjectMeta(
                    name=digest, options=ObjectMetaOptions(max_chunk_size=_chunk_bytes(nc))
                )
                await store.put(digest, _UntilDeadline(archive, deadline), meta=meta)
            return digest, True
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"pushing {directory!r} to the adapter store failed: {exc!r}") from exc


def _chunk_bytes(nc: NatsClient) -> int:
    """Chunks of ``_CHUNK_BYTES``, or half the server's largest message: a
    reader pays per message, so fewer, larger chunks fetch faster."""
    return max(1 << 16, min(_CHUNK_BYTES, int(nc.max_payload) // 2))


async def delete_object(
    nc: NatsClient, subjects: Subjects, digest: str, *, timeout_s: float = 10.0
) -> bool:
    """Delete the object of ``digest`` from the store; False when it was not there.
    The deletion marker nats-py leaves is purged too: nothing here watches for
    it, and the store's listing (:func:`stored_objects`) would grow by one for
    every object ever deleted."""
    bucket = subjects.adapter_store()
    name = base64.urlsafe_b64encode(check_digest(digest).encode()).decode()
    try:
        async with asyncio.timeout(timeout_s):
            store = await _store(nc, subjects)
            try:
                await store.delete(digest)
            except nats.js.errors.ObjectNotFoundError:
                return False
            await nc.jetstream().purge_stream(
                obj.OBJ_STREAM_TEMPLATE.format(bucket=bucket),
                subject=obj.OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=name),
            )
            return True
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"deleting {digest} from the adapter store failed: {exc!r}") from exc


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
    FetchFailed, naming the digest and why, for whatever goes wrong."""
    check_digest(digest)
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            info = await _read_meta(nc, subjects, digest)
            if info is None:
                raise FetchFailed(f"adapter {digest} is not in the fleet's store (or deleted)")
            _checked(info, digest, max_bytes)
            chunks = obj.OBJ_CHUNKS_PRE_TEMPLATE.format(
                bucket=subjects.adapter_store(), obj=info.nuid
            )
            return await _read_chunks(nc, subjects, chunks, info, into)
    except FetchFailed:
        raise
    except TimeoutError as exc:
        if deadline.expired():
            raise FetchFailed(f"adapter {digest}: not fetched within {timeout_s:g}s") from exc
        raise FetchFailed(f"adapter {digest}: the store stopped answering mid-transfer") from exc
    except (BusError, nats.errors.Error, OSError) as exc:
        raise FetchFailed(f"adapter {digest}: {exc}") from exc


def _checked(info: ObjectInfo, digest: str, max_bytes: int) -> None:
    """Raise FetchFailed unless the meta is one we can read safely. nats' own
    SHA-256 of the object is not checked: the adapter digest of what is
    unpacked is (agents/adapter_cache.py), and a second hash of every byte
    cost a fetch a third of its time."""
    if info.name != digest or info.is_link() or not _NUID.fullmatch(info.nuid or ""):
        raise FetchFailed(f"adapter {digest}: the stored meta is not one of a pushed adapter")
    if not isinstance(info.size, int) or not isinstance(info.chunks, int) or info.size < 0:
        raise FetchFailed(f"adapter {digest}: the stored meta has no valid size")
    if info.size > max_bytes:
        raise FetchFailed(f"adapter {digest} is {info.size} bytes, over the limit of {max_bytes}")


async def _read_chunks(
    nc: NatsClient, subjects: Subjects, chunks: str, info: ObjectInfo, into: ChunkSink
) -> int:
    """Read the chunks on ``chunks`` in order, a batch of direct gets at a time."""
    digest, size, count = info.name, int(info.size or 0), int(info.chunks or 0)
    seq, read, total = 1, 0, 0
    while read < count:
        batch = await _batch_again(nc, subjects, {"seq": seq, "next_by_subj": chunks})
        if not batch:
            raise FetchFailed(f"adapter {digest} is short: {read} of {count} chunks stored")
        for msg in batch:
            total += len(msg.data)
            read += 1
            if total > size or read > count:
                raise FetchFailed(f"adapter {digest}: its chunks hold more than its {size} bytes")
            # In a thread: a large file write can block.
            await asyncio.to_thread(into.write, msg.data)
            seq = int((msg.headers or {}).get("Nats-Sequence", "0")) + 1
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
    stream = obj.OBJ_STREAM_TEMPLATE.format(bucket=subjects.adapter_store())
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        request = {**start, "batch": 1024, "max_bytes": _BATCH_BYTES}
        await nc.publish(
            f"{js_api_of(nc)}.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox
        )
        found: list[Msg] = []
        while True:
            msg = await sub.next_msg(timeout=_READ_DEADLINE_S)
            status = (msg.headers or {}).get("Status", "")
            if not status:
                found.append(msg)
            elif status in ("204", "404"):  # the batch's end; nothing (more) stored
                return found
            elif status == "503":  # no replica answers yet: asked again, as a dead node is
                raise nats.errors.NoRespondersError
            else:
                raise BusError(f"reading the adapter store: {status} {_description(msg)}")
    finally:
        with contextlib.suppress(Exception):  # a connection gone: nothing to undo
            await sub.unsubscribe()


def _description(msg: Msg) -> str:
    return (msg.headers or {}).get("Description", "")
