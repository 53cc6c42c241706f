"""Adapters carried by the bus: a JetStream object store of the fleet, keyed by
the adapter's content digest, instead of a filesystem every host must mount.
This module writes the store, lists it and deletes from it; agents read it
(:mod:`lorabus.adapters.fetch`), bus paths name what it holds
(:mod:`lorabus.adapters.bus_paths`), and its subjects are laid out in
:mod:`lorabus.adapters.store_layout`.

The trainer side packs an adapter directory as a plain tar whose bytes depend
only on the files (sorted paths, fixed headers), taking its digest from the
same reads, and stores it under that digest; a digest already stored is not
sent again.

The store is written once, message by message: an object's chunks, then its
meta record, each on a subject of its own (their shapes: store_layout). The
stream takes only subjects of those shapes, keeps one message per subject,
refuses a second one (discard new per subject) and refuses rollup headers:
a publish can add an object, never replace, shadow or remove one. Only the
purge API removes anything, and only the coordinator may call it
(lorabus.security.roles): so the orchestrator, which publishes on these
subjects to push, cannot wipe the store. Chunks of a push that stopped
before its meta stay until the leader sweeps them
(coordinator/adapter_store.py). The stream has a size limit of its own, so
a full store refuses pushes and leaves the fleet's buckets their room.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from datetime import datetime
from typing import BinaryIO

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import (
    DiscardPolicy,
    ObjectInfo,
    ObjectMetaOptions,
    StorageType,
    StreamConfig,
)
from nats.js.client import JetStreamContext

from lorabus.adapters.archive import AdapterChanged, check_adapter_dir, pack
from lorabus.adapters.bus_paths import check_digest, is_digest
from lorabus.adapters.store_layout import (
    READ_DEADLINE_S,
    NotAnObject,
    chunk_subject,
    chunks_subject,
    first_stamp,
    get_stored,
    is_pushed,
    meta_subject,
    no_store_error,
    object_info,
    read_meta,
    stamp_of,
    stream_name,
)
from lorabus.errors import BadRequest, BusError
from lorabus.schemas import Subjects

__all__ = [
    "DEFAULT_STORE_MAX_BYTES",
    "StoreContents",
    "delete_chunks",
    "delete_meta",
    "delete_object",
    "object_size",
    "push_adapter",
    "store_config",
    "store_contents",
]

_CHUNK_SET = re.compile(r"^[^.*>\s]+\.[^.*>\s]+$")
_CHUNK_BYTES = 512 << 10
"""Four times nats-py's default chunk: on a 2-core machine, server on the same
host, a 128 MB fetch took 0.57 s in 128 KiB chunks and 1 MiB batches, 0.40 s
in 512 KiB chunks and 4 MiB batches (and its push 0.95 s, then 0.69 s)."""
DEFAULT_STORE_MAX_BYTES = 10 << 30
"""The store's size limit unless the operator gives another: full, it refuses
pushes, and the fleet's buckets keep the rest of JetStream's storage."""


def store_config(
    subjects: Subjects, *, replicas: int = 1, max_bytes: int = DEFAULT_STORE_MAX_BYTES
) -> StreamConfig:
    """The stream of the fleet's adapter store: file-backed, with direct gets
    (agents read nothing else), every subject written once (see the module
    docstring), and full at ``max_bytes`` (-1: no limit of its own)."""
    bucket = subjects.adapter_store()
    return StreamConfig(
        name=stream_name(subjects),
        subjects=[f"$O.{bucket}.C.*.*.*", f"$O.{bucket}.M.*"],
        max_bytes=max_bytes,
        max_consumers=0,
        max_msgs_per_subject=1,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        storage=StorageType.FILE,
        num_replicas=replicas,
        allow_rollup_hdrs=False,
        allow_direct=True,
    )


@dataclass(frozen=True)
class StoreContents:
    """What the store holds, each with when it was stored (seconds since the
    epoch, the server's clock; None: no valid time stamp)."""

    objects: dict[str, float | None]
    """Digest -> when, for every object a push stored whole (its meta)."""
    sizes: dict[str, int]
    """Digest -> its size in bytes, for the same objects."""
    complete: dict[str, bool]
    """Digest -> whether every chunk its meta counts is stored."""
    stray_metas: dict[str, float | None]
    """Meta subject -> when, for meta records that are no pushed adapter's."""
    stray_chunks: dict[str, float | None]
    """``<hex>.<nuid>`` -> when its first chunk was stored, for the chunks no
    object's meta names: a push that stopped before its meta (or one still
    under way)."""


async def store_contents(
    nc: NatsClient, subjects: Subjects, *, timeout_s: float = 30.0
) -> StoreContents:
    """Everything the store holds: the subjects from the stream's info, the
    chunks' first (a push that ends meanwhile then has its meta listed),
    then each meta record, and the first chunk of each set no meta names, by
    one direct get (the reads an agent may make too: no consumer). A record
    that cannot be read ends the listing (BusError): one taken for missing
    or stray could be deleted."""
    bucket = subjects.adapter_store()
    try:
        async with asyncio.timeout(timeout_s):
            js = nc.jetstream()
            listed = await js.stream_info(stream_name(subjects), subjects_filter=f"$O.{bucket}.C.>")
            chunk_sets: dict[str, int] = {}
            for chunk in listed.state.subjects or {}:
                key = chunk.removeprefix(f"$O.{bucket}.C.").rpartition(".")[0]
                chunk_sets[key] = chunk_sets.get(key, 0) + 1
            metas = await js.stream_info(stream_name(subjects), subjects_filter=f"$O.{bucket}.M.>")
            objects: dict[str, float | None] = {}
            sizes: dict[str, int] = {}
            complete: dict[str, bool] = {}
            stray: dict[str, float | None] = {}
            for meta in sorted(metas.state.subjects or {}):
                msg = await get_stored(nc, subjects, meta)
                if msg is None:  # purged since it was listed
                    continue
                try:
                    info: ObjectInfo | None = object_info(msg, meta)
                except NotAnObject:
                    info = None
                digest = str(info.name) if info is not None else ""
                if (
                    info is None
                    or info.deleted
                    or not is_digest(digest)
                    or meta != meta_subject(subjects, digest)
                    or not is_pushed(info, digest)
                ):
                    stray[meta] = stamp_of(msg)
                    continue
                key = chunks_subject(subjects, digest, str(info.nuid)).removeprefix(
                    f"$O.{bucket}.C."
                )
                objects[digest], sizes[digest] = stamp_of(msg), int(info.size or 0)
                complete[digest] = chunk_sets.pop(key, 0) == info.chunks
            unnamed = {
                key: await first_stamp(nc, subjects, f"$O.{bucket}.C.{key}.*")
                for key in sorted(chunk_sets)
            }
            return StoreContents(objects, sizes, complete, stray, unnamed)
    except nats.js.errors.NotFoundError as exc:
        raise no_store_error(subjects) from exc
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"listing the adapter store failed: {exc!r}") from exc


async def object_size(
    nc: NatsClient, subjects: Subjects, digest: str, *, timeout_s: float = 5.0
) -> int | None:
    """The size of the object stored under ``digest``; None when there is none.
    BusError when the store cannot be read."""
    try:
        async with asyncio.timeout(timeout_s):
            info = await read_meta(nc, subjects, check_digest(digest))
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot read the adapter store: {exc!r}") from exc
    return None if info is None else int(info.size or 0)


async def push_adapter(
    nc: NatsClient, subjects: Subjects, directory: str | os.PathLike[str], *, timeout_s: float = 600
) -> tuple[str, bool]:
    """Put the adapter in ``directory`` into the fleet's store under its digest;
    returns the digest and whether it was uploaded (False: already stored).

    The directory is read once: packed into a file of the machine's temporary
    directory (an adapter can be many GB) while its digest is taken from the
    same bytes, and a file that changes meanwhile fails the push
    (BadRequest). A push cut short stores no meta, so nothing under the
    digest; its chunks wait for the leader's sweep."""
    try:
        check_adapter_dir(directory)
    except (ValueError, OSError) as exc:
        raise BadRequest(f"cannot push {directory!r}: {exc}") from exc
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            with tempfile.TemporaryFile() as archive:
                try:
                    digest = await asyncio.to_thread(pack, directory, archive)
                except AdapterChanged as exc:
                    raise BadRequest(
                        f"cannot push {directory!r}: {exc}; push it again once it is "
                        "written whole (nothing was stored)"
                    ) from exc
                except (ValueError, OSError) as exc:
                    raise BadRequest(f"cannot push {directory!r}: {exc}") from exc
                if await read_meta(nc, subjects, digest) is not None:
                    return digest, False
                size = archive.tell()
                archive.seek(0)
                return digest, await _upload(nc, subjects, digest, archive, size)
    except TimeoutError as exc:
        if deadline.expired():
            raise BusError(
                f"pushing {directory!r} to the adapter store failed: not done within its "
                f"deadline of {timeout_s:g}s (nothing was stored under its digest)"
            ) from exc
        raise BusError(
            f"pushing {directory!r} to the adapter store failed: the store did not "
            f"answer within {READ_DEADLINE_S:g}s (nothing was stored under its digest)"
        ) from exc
    except nats.errors.Error as exc:
        raise BusError(f"pushing {directory!r} to the adapter store failed: {exc!r}") from exc


async def _upload(
    nc: NatsClient, subjects: Subjects, digest: str, archive: BinaryIO, size: int
) -> bool:
    """Publish the chunks of ``archive``, then its meta; False when the same
    digest was stored whole meanwhile (by another push)."""
    js = nc.jetstream()
    # Random, not nats's sequential nuids: nobody can take this push's chunk
    # subjects before it does.
    nuid = secrets.token_hex(11)
    chunk = _chunk_bytes(nc)
    count = 0
    while data := await asyncio.to_thread(archive.read, chunk):
        try:
            await _publish(js, subjects, chunk_subject(subjects, digest, nuid, count), data)
        except _SubjectTaken as exc:
            raise BusError(
                f"pushing {digest}: chunk {count} of this push was stored already, by "
                "another hand: push again (nothing was stored under its digest)"
            ) from exc
        count += 1
    info = ObjectInfo(
        name=digest,
        bucket=subjects.adapter_store(),
        nuid=nuid,
        size=size,
        chunks=count,
        mtime=datetime.now().astimezone().isoformat(),
        options=ObjectMetaOptions(max_chunk_size=chunk),
    )
    try:
        await _publish(
            js, subjects, meta_subject(subjects, digest), json.dumps(info.as_dict()).encode()
        )
    except _SubjectTaken:
        # Another push of the same bytes stored its meta first: the object is
        # there (ours are chunks nobody names, for the sweep), unless what
        # holds the subject is no pushed adapter's.
        if await read_meta(nc, subjects, digest) is None:
            raise BusError(
                f"the adapter store holds a meta record for {digest} that is no pushed "
                "adapter's: the leader removes it once it is older than its --orphan-after"
            ) from None
        return False
    return True


class _SubjectTaken(BusError):
    """A publish on a subject that holds a message already (written once)."""


async def _publish(js: JetStreamContext, subjects: Subjects, subject: str, data: bytes) -> None:
    try:
        await js.publish(subject, data, timeout=READ_DEADLINE_S)
    except nats.js.errors.APIError as exc:
        said = str(exc.description or "")
        if "per subject" in said:
            raise _SubjectTaken(said) from exc
        if "maximum bytes" in said or "resource limits" in said or "insufficient" in said:
            whose = f"tenant {subjects.store!r}'s" if subjects.store else "the fleet's"
            limit = "its max_bytes in the tenants file" if subjects.store else "its limit"
            raise BusError(
                f"{whose} adapter store {subjects.adapter_store()!r} is full ({said}): "
                "the leader deletes what nothing keeps once it is older than its "
                "--orphan-after (lorabus adapter list shows what the store holds); "
                f"{limit} is set when the store is provisioned (docs/security.md, 'The "
                "fleet's streams')"
            ) from exc
        raise


def _chunk_bytes(nc: NatsClient) -> int:
    """Chunks of ``_CHUNK_BYTES``, or half the server's largest message: a
    reader pays per message, so fewer, larger chunks fetch faster."""
    return max(1 << 16, min(_CHUNK_BYTES, int(nc.max_payload) // 2))


async def delete_object(
    nc: NatsClient, subjects: Subjects, digest: str, *, timeout_s: float = 10.0
) -> bool:
    """Delete the object of ``digest`` from the store; False when it was not there.
    Its meta goes first (from then on nobody finds it), then its chunks."""
    try:
        async with asyncio.timeout(timeout_s):
            info = await read_meta(nc, subjects, check_digest(digest))
            if info is None:
                return False
            await delete_meta(nc, subjects, meta_subject(subjects, digest), timeout_s=timeout_s)
            # Its own chunks only: they live under its digest.
            key = chunks_subject(subjects, digest, str(info.nuid))
            await _purge(nc, subjects, f"{key}.>", timeout_s)
            return True
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"deleting {digest} from the adapter store failed: {exc!r}") from exc


async def delete_meta(
    nc: NatsClient, subjects: Subjects, meta: str, *, timeout_s: float = 10.0
) -> None:
    """Purge the meta record on subject ``meta`` (the coordinator's right alone)."""
    await _purge(nc, subjects, meta, timeout_s)


async def delete_chunks(
    nc: NatsClient, subjects: Subjects, key: str, *, timeout_s: float = 10.0
) -> None:
    """Purge every chunk of the set ``key`` (``<hex>.<nuid>``, as
    :attr:`StoreContents.stray_chunks` names it; the coordinator's right
    alone). ValueError for a key that is not two subject tokens."""
    if not _CHUNK_SET.fullmatch(key):
        raise ValueError(f"{key!r} names no set of chunks of the store")
    await _purge(nc, subjects, f"$O.{subjects.adapter_store()}.C.{key}.>", timeout_s)


async def _purge(nc: NatsClient, subjects: Subjects, subject: str, timeout_s: float) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await nc.jetstream().purge_stream(stream_name(subjects), subject=subject)
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"purging {subject} from the adapter store failed: {exc!r}") from exc
