"""The adapter store's layout, and the reads of it by single direct gets that
pushing, listing and fetching all make.

An object is its chunks, one per subject
(``$O.<bucket>.C.<hex of the digest>.<nuid>.<index>``, the nuid random per
push), then its meta record (``$O.<bucket>.M.<base64 of the digest>``, nats's
object info). An object's chunks live under its own digest: a meta record
naming another object's nuid names no chunk of it, and deleting an object
purges nothing of another (:mod:`lorabus.adapters.store`).

Every read here is one direct get, asked again for a moment while no replica
answers: direct gets are all an agent may make (docs/security.md), and a
store that does not answer is never taken for one that holds nothing.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from datetime import datetime

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import ObjectInfo

from lorabus.bus.connect import js_api_of
from lorabus.errors import BusError
from lorabus.schemas import Subjects

__all__ = [
    "READ_DEADLINE_S",
    "NotAnObject",
    "chunk_subject",
    "chunks_subject",
    "first_stamp",
    "get_stored",
    "is_pushed",
    "meta_subject",
    "no_store_error",
    "object_info",
    "read_meta",
    "read_meta_at",
    "stamp_of",
    "status_description",
    "stream_name",
]

_NUID = re.compile(r"^[A-Za-z0-9]{1,64}$")
READ_DEADLINE_S = 5.0
"""How long one read of the store (a meta, the next chunk of a batch) may take."""
_STAMP = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)")
"""JetStream's time stamps: RFC 3339 with up to nanoseconds."""
_NO_RESPONDERS_PAUSES_S = (0.1, 0.2, 0.4, 0.8, 1.0)
"""Pauses before asking a direct get again that nobody answered: in a
cluster, only a stream's current replicas answer them, and after a node
restarts there can be a moment with none (seen: an update refused as if the
store were missing). A store that is really missing is said after 2.5 s."""


class NotAnObject(BusError):
    """Raised when a meta subject holds something that is no object info."""


def stream_name(subjects: Subjects) -> str:
    """The name of the stream that holds the adapter store of ``subjects``."""
    return f"OBJ_{subjects.adapter_store()}"


def meta_subject(subjects: Subjects, digest: str) -> str:
    """The subject of the meta record of ``digest``'s object."""
    name = base64.urlsafe_b64encode(digest.encode()).decode()  # as nats names an object
    return f"$O.{subjects.adapter_store()}.M.{name}"


def chunks_subject(subjects: Subjects, digest: str, nuid: str) -> str:
    """Where the chunks of one push of ``digest`` live: under its own digest."""
    return f"$O.{subjects.adapter_store()}.C.{digest.removeprefix('sha256:')}.{nuid}"


def chunk_subject(subjects: Subjects, digest: str, nuid: str, index: int | str) -> str:
    """The subject of chunk ``index`` (or ``"*"``: every chunk) of one push of ``digest``."""
    return f"{chunks_subject(subjects, digest, nuid)}.{index}"


def no_store_error(subjects: Subjects) -> BusError:
    """What a store that is not there, or not readable with direct gets, is said as."""
    return BusError(
        f"fleet {subjects.fleet!r} has no adapter store {subjects.adapter_store()!r} "
        "readable with direct gets: run lorabus provision (as the operator)"
    )


async def read_meta(nc: NatsClient, subjects: Subjects, digest: str) -> ObjectInfo | None:
    """The stored object's info (None: none, or not a pushed adapter's), by one direct get."""
    try:
        found = await read_meta_at(nc, subjects, meta_subject(subjects, digest))
    except NotAnObject:
        return None
    if found is None or not is_pushed(found[0], digest):
        return None
    return found[0]


async def read_meta_at(
    nc: NatsClient, subjects: Subjects, meta: str
) -> tuple[ObjectInfo, float | None] | None:
    """The info stored on meta subject ``meta`` and when it was stored (None:
    no valid time stamp); None: none there, or marked deleted. NotAnObject
    when what is there is no object info; BusError when it cannot be read."""
    msg = await get_stored(nc, subjects, meta)
    if msg is None:
        return None
    info = object_info(msg, meta)
    return None if info.deleted else (info, stamp_of(msg))


async def get_stored(nc: NatsClient, subjects: Subjects, subject: str) -> Msg | None:
    """The message stored on ``subject`` (None: none). BusError when it
    cannot be read: a store that does not answer is never taken for one that
    holds nothing."""
    msg = await _direct_get(nc, subjects, f".{subject}", b"")
    status = (msg.headers or {}).get("Status", "")
    if status == "404":
        return None
    if status:
        raise BusError(f"reading the adapter store: {status} {status_description(msg)}")
    return msg


async def first_stamp(nc: NatsClient, subjects: Subjects, subject: str) -> float | None:
    """When the first message on ``subject`` (wildcards allowed) was stored:
    a push's age is its first chunk's, whatever was added to it since.
    None: none there any more, or undated. BusError when it cannot be read."""
    body = json.dumps({"seq": 1, "next_by_subj": subject}).encode()
    msg = await _direct_get(nc, subjects, "", body)
    status = (msg.headers or {}).get("Status", "")
    if status == "404":
        return None
    if status:
        raise BusError(f"reading the adapter store: {status} {status_description(msg)}")
    return stamp_of(msg)


def object_info(msg: Msg, meta: str) -> ObjectInfo:
    """The object info ``msg``, stored on meta subject ``meta``, holds;
    NotAnObject when it holds none."""
    try:
        return ObjectInfo.from_response(json.loads(msg.data))
    except (ValueError, TypeError, AttributeError) as exc:
        raise NotAnObject(f"the stored meta on {meta} is not valid: {exc}") from exc


async def _direct_get(nc: NatsClient, subjects: Subjects, suffix: str, body: bytes) -> Msg:
    """One direct get of the store (``suffix``: "" or "." and a subject),
    asked again while no replica answers (see ``_NO_RESPONDERS_PAUSES_S``)."""
    subject = f"{js_api_of(nc)}.DIRECT.GET.{stream_name(subjects)}{suffix}"
    for pause in (*_NO_RESPONDERS_PAUSES_S, None):
        try:
            return await nc.request(subject, body, timeout=READ_DEADLINE_S)
        except nats.errors.NoRespondersError as exc:
            if pause is None:
                raise no_store_error(subjects) from exc
            await asyncio.sleep(pause)
    raise AssertionError("unreachable")


def is_pushed(info: ObjectInfo, digest: str) -> bool:
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


def stamp_of(msg: Msg) -> float | None:
    """When a message read by a direct get was stored, in seconds since the
    epoch (the server's clock); None when it has no valid time stamp."""
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


def status_description(msg: Msg) -> str:
    """What the server said of a status it answered a direct get with."""
    return (msg.headers or {}).get("Description", "")
