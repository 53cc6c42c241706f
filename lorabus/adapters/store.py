"""Adapters carried by the bus: a JetStream object store of the fleet, keyed by
the adapter's content digest, instead of a filesystem every host must mount.

The trainer side packs an adapter directory as a plain tar whose bytes depend
only on the files (sorted paths, fixed headers), taking its digest from the
same reads, and stores it under that digest; a digest already stored is not
sent again. Agents read an object with JetStream direct gets only: the meta
by its subject, then its chunks by subject and sequence. A consumer would
need more rights, and its deliver subject would let an agent aim JetStream
(docs/security.md). What an agent fetches is unpacked as it arrives and
checked against the adapter digest by the agent's cache
(lorabus.agents.adapter_cache).

The store is written once, message by message. An object is its chunks, one
per subject (``$O.<bucket>.C.<hex of the digest>.<nuid>.<index>``, the nuid
random per push), then its meta record (``$O.<bucket>.M.<base64 of the
digest>``, nats's object info). The stream takes only subjects of those
shapes, keeps one message per subject, refuses a second one (discard new
per subject) and refuses rollup headers: a publish can add an object, never
replace, shadow or remove one. Only the purge API removes anything, and only
the coordinator may call it (lorabus.security.roles): so the orchestrator, which
publishes on these subjects to push, cannot wipe the store. An object's
chunks live under its own digest: a meta record naming another object's
nuid names no chunk of it, and deleting an object purges nothing of
another. Chunks of a push that stopped before its meta stay until the
leader sweeps them (coordinator/adapter_store.py). The stream has a size
limit of its own, so a full store refuses pushes and leaves the fleet's
buckets their room.

A request names such an adapter by a *bus path*: ``bus:sha256:<hex>`` in
the fleet's store, ``bus:<tenant>/sha256:<hex>`` in a tenant's. Each tenant
pushes into a store of its own (``Subjects.for_store``), bounded by its
quota of bytes, where no other tenant may write: the part of a bus path
before the digest, its *object key*, says which store holds it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from datetime import datetime
from typing import BinaryIO, Protocol

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import (
    DiscardPolicy,
    ObjectInfo,
    ObjectMetaOptions,
    StorageType,
    StreamConfig,
)
from nats.js.client import JetStreamContext

from lorabus.adapters.archive import AdapterChanged, BadArchive, check_adapter_dir, pack
from lorabus.bus.connect import js_api_of
from lorabus.errors import BadRequest, BusError, FetchFailed
from lorabus.schemas import Subjects, check_tenant

__all__ = [
    "BUS_SCHEME",
    "DEFAULT_STORE_MAX_BYTES",
    "ChunkSink",
    "StoreContents",
    "bus_path",
    "check_digest",
    "delete_chunks",
    "delete_meta",
    "delete_object",
    "digest_of",
    "fetch_object",
    "key_of",
    "object_key",
    "object_size",
    "push_adapter",
    "split_key",
    "store_config",
    "store_contents",
    "store_of",
]

BUS_SCHEME = "bus:"


class ChunkSink(Protocol):
    """Where a fetch writes an object's bytes, in order, from a thread: an
    agent's :class:`~lorabus.adapters.archive.Unpacker`, which unpacks them
    as they come."""

    def write(self, data: bytes, /) -> int: ...


_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_NUID = re.compile(r"^[A-Za-z0-9]{1,64}$")
_CHUNK_SET = re.compile(r"^[^.*>\s]+\.[^.*>\s]+$")
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
DEFAULT_STORE_MAX_BYTES = 10 << 30
"""The store's size limit unless the operator gives another: full, it refuses
pushes, and the fleet's buckets keep the rest of JetStream's storage."""


def check_digest(digest: str) -> str:
    """``digest`` if it is an adapter digest (``sha256:<64 hex>``), else ValueError."""
    if not _DIGEST.fullmatch(digest):
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


def store_config(
    subjects: Subjects, *, replicas: int = 1, max_bytes: int = DEFAULT_STORE_MAX_BYTES
) -> StreamConfig:
    """The stream of the fleet's adapter store: file-backed, with direct gets
    (agents read nothing else), every subject written once (see the module
    docstring), and full at ``max_bytes`` (-1: no limit of its own)."""
    bucket = subjects.adapter_store()
    return StreamConfig(
        name=_stream(subjects),
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


def _stream(subjects: Subjects) -> str:
    return f"OBJ_{subjects.adapter_store()}"


def _meta_subject(subjects: Subjects, digest: str) -> str:
    name = base64.urlsafe_b64encode(digest.encode()).decode()  # as nats names an object
    return f"$O.{subjects.adapter_store()}.M.{name}"


def _chunks_of(subjects: Subjects, digest: str, nuid: str) -> str:
    """Where the chunks of one push of ``digest`` live: under its own digest."""
    return f"$O.{subjects.adapter_store()}.C.{digest.removeprefix('sha256:')}.{nuid}"


def _chunk_subject(subjects: Subjects, digest: str, nuid: str, index: int | str) -> str:
    return f"{_chunks_of(subjects, digest, nuid)}.{index}"


def _no_store(subjects: Subjects) -> BusError:
    return BusError(
        f"fleet {subjects.fleet!r} has no adapter store {subjects.adapter_store()!r} "
        "readable with direct gets: run lorabus provision (as the operator)"
    )


async def _read_meta(nc: NatsClient, subjects: Subjects, digest: str) -> ObjectInfo | None:
    """The stored object's info (None: none, or not a pushed adapter's), by one direct get."""
    try:
        found = await _read_meta_at(nc, subjects, _meta_subject(subjects, digest))
    except NotAnObject:
        return None
    if found is None or not _is_pushed(found[0], digest):
        return None
    return found[0]


async def _read_meta_at(
    nc: NatsClient, subjects: Subjects, meta: str
) -> tuple[ObjectInfo, float | None] | None:
    """The info stored on meta subject ``meta`` and when it was stored (None:
    no valid time stamp); None: none there, or marked deleted. NotAnObject
    when what is there is no object info; BusError when it cannot be read."""
    msg = await _get_stored(nc, subjects, meta)
    if msg is None:
        return None
    info = _object_info(msg, meta)
    return None if info.deleted else (info, _stamp_of(msg))


class NotAnObject(BusError):
    """Raised when a meta subject holds something that is no object info."""


async def _get_stored(nc: NatsClient, subjects: Subjects, subject: str) -> Msg | None:
    """The message stored on ``subject`` (None: none). BusError when it
    cannot be read: a store that does not answer is never taken for one that
    holds nothing."""
    msg = await _direct_get(nc, subjects, f".{subject}", b"")
    status = (msg.headers or {}).get("Status", "")
    if status == "404":
        return None
    if status:
        raise BusError(f"reading the adapter store: {status} {_description(msg)}")
    return msg


def _object_info(msg: Msg, meta: str) -> ObjectInfo:
    try:
        return ObjectInfo.from_response(json.loads(msg.data))
    except (ValueError, TypeError, AttributeError) as exc:
        raise NotAnObject(f"the stored meta on {meta} is not valid: {exc}") from exc


async def _direct_get(nc: NatsClient, subjects: Subjects, suffix: str, body: bytes) -> Msg:
    """One direct get of the store (``suffix``: "" or "." and a subject),
    asked again while no replica answers (see ``_NO_RESPONDERS_PAUSES_S``)."""
    subject = f"{js_api_of(nc)}.DIRECT.GET.{_stream(subjects)}{suffix}"
    for pause in (*_NO_RESPONDERS_PAUSES_S, None):
        try:
            return await nc.request(subject, body, timeout=_READ_DEADLINE_S)
        except nats.errors.NoRespondersError as exc:
            if pause is None:
                raise _no_store(subjects) from exc
            await asyncio.sleep(pause)
    raise AssertionError("unreachable")


def _is_pushed(info: ObjectInfo, digest: str) -> bool:
    """Whether ``info`` is what a push stores for ``digest``: its name, a nuid
    that names nothing but its own chunks, sizes that are numbers."""
    return (
        info.name == digest
        and not info.is_link()
        and bool(_NUID.fullmatch(info.nuid or ""))
        and isinstance(info.size, int)
        and isinstance(info.chunks, int)
        and info.size >= 0
        and info.chunks >= 0
    )


def _stamp_of(msg: Msg) -> float | None:
    try:
        return _server_time((msg.headers or {}).get("Nats-Time-Stamp", ""))
    except ValueError:
        return None


def _server_time(stamp: str) -> float:
    """A JetStream time stamp (RFC 3339, nanoseconds) in seconds since the epoch."""
    found = _STAMP.fullmatch(stamp)
    if found is None:
        raise ValueError(f"not a time stamp: {stamp!r}")
    whole, fraction, zone = found.groups()
    at = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone)).timestamp()
    return at + float(f"0{fraction}" if fraction else 0)


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
            listed = await js.stream_info(_stream(subjects), subjects_filter=f"$O.{bucket}.C.>")
            chunk_sets: dict[str, int] = {}
            for chunk in listed.state.subjects or {}:
                key = chunk.removeprefix(f"$O.{bucket}.C.").rpartition(".")[0]
                chunk_sets[key] = chunk_sets.get(key, 0) + 1
            metas = await js.stream_info(_stream(subjects), subjects_filter=f"$O.{bucket}.M.>")
            objects: dict[str, float | None] = {}
            sizes: dict[str, int] = {}
            complete: dict[str, bool] = {}
            stray: dict[str, float | None] = {}
            for meta in sorted(metas.state.subjects or {}):
                msg = await _get_stored(nc, subjects, meta)
                if msg is None:  # purged since it was listed
                    continue
                try:
                    info: ObjectInfo | None = _object_info(msg, meta)
                except NotAnObject:
                    info = None
                digest = str(info.name) if info is not None else ""
                if (
                    info is None
                    or info.deleted
                    or not _DIGEST.fullmatch(digest)
                    or meta != _meta_subject(subjects, digest)
                    or not _is_pushed(info, digest)
                ):
                    stray[meta] = _stamp_of(msg)
                    continue
                key = _chunks_of(subjects, digest, str(info.nuid)).removeprefix(f"$O.{bucket}.C.")
                objects[digest], sizes[digest] = _stamp_of(msg), int(info.size or 0)
                complete[digest] = chunk_sets.pop(key, 0) == info.chunks
            unnamed = {
                key: await _first_stamp(nc, subjects, f"$O.{bucket}.C.{key}.*")
                for key in sorted(chunk_sets)
            }
            return StoreContents(objects, sizes, complete, stray, unnamed)
    except nats.js.errors.NotFoundError as exc:
        raise _no_store(subjects) from exc
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"listing the adapter store failed: {exc!r}") from exc


async def _first_stamp(nc: NatsClient, subjects: Subjects, subject: str) -> float | None:
    """When the first message on ``subject`` (wildcards allowed) was stored:
    a push's age is its first chunk's, whatever was added to it since.
    None: none there any more, or undated. BusError when it cannot be read."""
    body = json.dumps({"seq": 1, "next_by_subj": subject}).encode()
    msg = await _direct_get(nc, subjects, "", body)
    status = (msg.headers or {}).get("Status", "")
    if status == "404":
        return None
    if status:
        raise BusError(f"reading the adapter store: {status} {_description(msg)}")
    return _stamp_of(msg)


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
                if await _read_meta(nc, subjects, digest) is not None:
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
            f"answer within {_READ_DEADLINE_S:g}s (nothing was stored under its digest)"
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
            await _publish(js, subjects, _chunk_subject(subjects, digest, nuid, count), data)
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
            js, subjects, _meta_subject(subjects, digest), json.dumps(info.as_dict()).encode()
        )
    except _SubjectTaken:
        # Another push of the same bytes stored its meta first: the object is
        # there (ours are chunks nobody names, for the sweep), unless what
        # holds the subject is no pushed adapter's.
        if await _read_meta(nc, subjects, digest) is None:
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
        await js.publish(subject, data, timeout=_READ_DEADLINE_S)
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
            info = await _read_meta(nc, subjects, check_digest(digest))
            if info is None:
                return False
            await delete_meta(nc, subjects, _meta_subject(subjects, digest), timeout_s=timeout_s)
            # Its own chunks only: they live under its digest.
            key = _chunks_of(subjects, digest, str(info.nuid))
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
            await nc.jetstream().purge_stream(_stream(subjects), subject=subject)
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"purging {subject} from the adapter store failed: {exc!r}") from exc


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
            found = await _read_meta_at(nc, subjects, _meta_subject(subjects, digest))
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
    if not _is_pushed(info, digest):
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
    wildcard = _chunk_subject(subjects, digest, nuid, "*")
    while read < count:
        batch = await _batch_again(nc, subjects, {"seq": seq, "next_by_subj": wildcard})
        if not batch:
            raise FetchFailed(f"adapter {digest} is short: {read} of {count} chunks stored")
        for msg in batch:
            headers = msg.headers or {}
            seq = int(headers.get("Nats-Sequence", "")) + 1
            if read == count or headers.get("Nats-Subject") != _chunk_subject(
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
            f"{js_api_of(nc)}.DIRECT.GET.{_stream(subjects)}",
            json.dumps(request).encode(),
            reply=inbox,
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
