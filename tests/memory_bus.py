"""An in-memory NATS: the part of nats-py's surface lorabus uses, in one process.

The real :class:`~lorabus.agents.Agent` and the real
:class:`~lorabus.coordinator.service.Coordinator` take a nats-py client and
reach NATS only through ``agents/bus.py`` and the coordinator's bus modules.
:class:`MemoryNats` offers what those modules call, so both run unchanged on
it, on looptime's fake clock: no server, no sockets, milliseconds whatever the
timeouts. What it offers, and how it behaves (as nats-server 2.15 does, for
what lorabus relies on):

- core subjects: ``publish`` (reply subject, headers), ``subscribe`` with a
  callback (handled one message at a time per subscription, in publish order)
  or without (``next_msg``), ``request`` (``NoRespondersError`` when nobody
  listens; a reply-less publish nobody hears gets a 503 status message on its
  reply subject, as the server sends one), ``flush``, ``new_inbox``; subject
  wildcards ``*`` (one token) and ``>`` (one or more tail tokens);
- JetStream: ``add_stream``/``update_stream``/``stream_info`` keep the
  stream's config (so ``provision`` and the term's stream checks run as
  written), ``stream_info`` of a bucket's stream with ``subjects_filter``
  lists the keys that match (deleted ones too: a delete leaves a marker),
  and ``key_value`` binds to a bucket whose stream ``KV_<bucket>``
  exists (else ``BucketNotFoundError``);
- KV: ``get``/``put``/``create``/``update(last=)``/``delete``, one revision
  sequence per bucket, delete markers (a deleted key's ``get`` raises
  ``KeyDeletedError`` carrying its revision, which a ``create`` may reuse),
  ``KeyWrongLastSequenceError`` on a lost compare-and-set.

Faults are the bus's, never an agent's script: :meth:`MemoryServer.drop`
loses chosen messages on their way to one connection (core NATS is
at-most-once), and :meth:`MemoryNats.cut` partitions a connection (nothing in,
nothing out), as a dead link does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import StreamConfig
from nats.js.kv import KeyValue

from lorabus.schemas import MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

Callback = Callable[[Msg], Awaitable[None]]
DropRule = Callable[[str, str, bytes], bool]
"""(connection name, subject, payload) -> whether this delivery is lost."""
_NAME_IN_USE = 10058


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


class MemoryServer:
    """What the connections share: subscriptions, streams, buckets, faults."""

    def __init__(self) -> None:
        self._subs: list[MemorySubscription] = []
        self.streams: dict[str, StreamConfig] = {}
        self.buckets: dict[str, MemoryKeyValue] = {}
        self._drops: list[tuple[DropRule, list[int]]] = []
        self.published: list[tuple[str, bytes]] = []
        """(subject, payload) of every message a connection sent, in order."""

    def connect(self, name: str = "") -> MemoryNats:
        return MemoryNats(self, name)

    def drop(self, rule: DropRule, *, times: int = 1) -> None:
        """Lose the next ``times`` deliveries ``rule`` picks."""
        self._drops.append((rule, [times]))

    def _lost(self, conn: str, subject: str, data: bytes) -> bool:
        for rule, left in self._drops:
            if left[0] > 0 and rule(conn, subject, data):
                left[0] -= 1
                return True
        return False

    def _route(self, msg_subject: str, reply: str, data: bytes, headers: Any) -> int:
        """Deliver to every matching subscription; how many matched."""
        matched = 0
        for sub in list(self._subs):
            if not subject_matches(sub.subject, msg_subject):
                continue
            matched += 1
            if sub.conn.is_cut or self._lost(sub.conn.name, msg_subject, data):
                continue
            msg = Msg(
                _client=sub.conn,  # type: ignore[arg-type]
                subject=msg_subject,
                reply=reply,
                data=data,
                headers=dict(headers) if headers else None,
            )
            sub._queue.put_nowait(msg)
        return matched


class MemorySubscription:
    def __init__(self, conn: MemoryNats, subject: str, cb: Callback | None) -> None:
        self.conn = conn
        self.subject = subject
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        if cb is not None:
            self._task = asyncio.get_running_loop().create_task(self._deliver(cb))

    async def _deliver(self, cb: Callback) -> None:
        while True:
            msg = await self._queue.get()
            try:
                await cb(msg)
            except asyncio.CancelledError:
                raise
            except Exception:  # nats-py hands it to error_cb and goes on
                log.exception("callback on %s raised", msg.subject)

    async def next_msg(self, timeout: float | None = 1.0) -> Msg:  # noqa: ASYNC109 (nats-py's)
        try:
            async with asyncio.timeout(timeout):
                return await self._queue.get()
        except TimeoutError:
            raise nats.errors.TimeoutError from None

    async def unsubscribe(self) -> None:
        self.conn._drop(self)


class MemoryNats:
    """One connection to a :class:`MemoryServer`, shaped as nats-py's client."""

    max_payload = MAX_MESSAGE_BYTES

    def __init__(self, server: MemoryServer, name: str) -> None:
        self.server = server
        self.name = name
        self.stats = {"reconnects": 0}
        self.is_cut = False
        self.is_closed = False
        self._subs: list[MemorySubscription] = []
        self._inboxes = itertools.count(1)

    @property
    def is_connected(self) -> bool:
        return not (self.is_cut or self.is_closed)

    def cut(self) -> None:
        """Partition this connection: what it sends and what is sent to it is lost."""
        self.is_cut = True

    def heal(self) -> None:
        """End the partition: what was lost stays lost, what comes next flows."""
        self.is_cut = False

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: Any = None
    ) -> None:
        if self.is_closed:
            raise nats.errors.ConnectionClosedError
        if self.is_cut:
            return
        await asyncio.sleep(0)  # a publish returns before anyone has read it
        self.server.published.append((subject, payload))
        matched = self.server._route(subject, reply, payload, headers)
        if not matched and reply:
            self.server._route(reply, "", b"", {"Status": "503"})

    async def subscribe(
        self, subject: str, queue: str = "", cb: Callback | None = None
    ) -> MemorySubscription:
        sub = MemorySubscription(self, subject, cb)
        self._subs.append(sub)
        self.server._subs.append(sub)
        return sub

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,  # noqa: ASYNC109 (nats-py's signature)
        headers: Any = None,
    ) -> Msg:
        inbox = self.new_inbox()
        sub = await self.subscribe(inbox)
        try:
            await self.publish(subject, payload, reply=inbox, headers=headers)
            msg = await sub.next_msg(timeout=timeout)
        finally:
            await sub.unsubscribe()
        if not msg.data and (msg.headers or {}).get("Status") == "503":
            raise nats.errors.NoRespondersError
        return msg

    async def flush(self, timeout: float = 10) -> None:  # noqa: ASYNC109 (nats-py's)
        await asyncio.sleep(0)

    def new_inbox(self) -> str:
        return f"_INBOX.{secrets.token_hex(6)}{next(self._inboxes)}"

    def jetstream(self) -> MemoryJetStream:
        return MemoryJetStream(self)

    async def close(self) -> None:
        self.is_closed = True
        for sub in list(self._subs):
            self._drop(sub)

    def _drop(self, sub: MemorySubscription) -> None:
        with contextlib.suppress(ValueError):
            self._subs.remove(sub)
        with contextlib.suppress(ValueError):
            self.server._subs.remove(sub)
        if sub._task is not None:
            sub._task.cancel()


@dataclass
class _StreamState:
    subjects: dict[str, int] | None = None


@dataclass
class _StreamInfo:
    config: StreamConfig
    state: _StreamState = field(default_factory=_StreamState)


class MemoryJetStream:
    def __init__(self, conn: MemoryNats) -> None:
        self._conn = conn
        self._server = conn.server

    def _check(self) -> None:
        if self._conn.is_cut or self._conn.is_closed:
            raise nats.errors.TimeoutError

    async def add_stream(self, config: StreamConfig) -> _StreamInfo:
        self._check()
        name = str(config.name)
        known = self._server.streams.get(name)
        if known is not None and known != config:
            raise nats.js.errors.BadRequestError(err_code=_NAME_IN_USE)
        self._server.streams[name] = config
        return _StreamInfo(config)

    async def update_stream(self, config: StreamConfig) -> _StreamInfo:
        self._check()
        self._server.streams[str(config.name)] = config
        return _StreamInfo(config)

    async def stream_info(self, name: str, subjects_filter: str | None = None) -> _StreamInfo:
        self._check()
        if name not in self._server.streams:
            raise nats.js.errors.NotFoundError
        info = _StreamInfo(self._server.streams[name])
        bucket = self._server.buckets.get(name.removeprefix("KV_"))
        if subjects_filter and name.startswith("KV_") and bucket is not None:
            subjects = (f"$KV.{bucket.bucket}.{key}" for key in bucket._data.entries)
            info.state.subjects = {s: 1 for s in subjects if subject_matches(subjects_filter, s)}
        return info

    async def key_value(self, bucket: str) -> MemoryKeyValue:
        self._check()
        if f"KV_{bucket}" not in self._server.streams:
            raise nats.js.errors.BucketNotFoundError
        kv = self._server.buckets.setdefault(bucket, MemoryKeyValue(bucket))
        return kv.bound_to(self._conn)


@dataclass
class _Bucket:
    entries: dict[str, KeyValue.Entry] = field(default_factory=dict)
    revision: int = 0
    written: list[KeyValue.Entry] = field(default_factory=list)
    """Every write, oldest first (JetStream keeps a key's history too)."""


class MemoryKeyValue:
    """A JetStream KV bucket as lorabus uses it; a partitioned connection's
    calls fail as an unreachable server's do (a timeout)."""

    def __init__(self, bucket: str, data: _Bucket | None = None) -> None:
        self.bucket = bucket
        self._data = data or _Bucket()
        self._conn: MemoryNats | None = None

    def bound_to(self, conn: MemoryNats) -> MemoryKeyValue:
        view = MemoryKeyValue(self.bucket, self._data)
        view._conn = conn
        return view

    # What nats-py's KeyValue keeps privately, and lorabus lists keys with.
    @property
    def _js(self) -> MemoryJetStream:
        if self._conn is None:
            raise AttributeError("an unbound bucket lists nothing")
        return self._conn.jetstream()

    @property
    def _stream(self) -> str:
        return f"KV_{self.bucket}"

    @property
    def _name(self) -> str:
        return self.bucket

    def history(self, key: str) -> list[KeyValue.Entry]:
        """Every write of ``key``, oldest first, delete markers included."""
        return [entry for entry in self._data.written if entry.key == key]

    def _check(self) -> None:
        if self._conn is not None and (self._conn.is_cut or self._conn.is_closed):
            raise nats.errors.TimeoutError

    async def get(self, key: str) -> KeyValue.Entry:
        self._check()
        await asyncio.sleep(0)
        entry = self._data.entries.get(key)
        if entry is None:
            raise nats.js.errors.KeyNotFoundError
        if entry.operation == "DEL":  # as nats-py's get raises it
            raise nats.js.errors.KeyNotFoundError(entry, "DEL")
        return entry

    async def put(self, key: str, value: bytes, **_: Any) -> int:
        self._check()
        await asyncio.sleep(0)
        return self._write(key, value, None)

    async def create(self, key: str, value: bytes, **_: Any) -> int:
        self._check()
        await asyncio.sleep(0)
        entry = self._data.entries.get(key)
        if entry is not None and entry.operation != "DEL":
            raise nats.js.errors.KeyWrongLastSequenceError(
                description=f"wrong last sequence: {entry.revision}"
            )
        return self._write(key, value, None)

    async def update(self, key: str, value: bytes, last: int | None = None, **_: Any) -> int:
        self._check()
        await asyncio.sleep(0)
        entry = self._data.entries.get(key)
        current = entry.revision if entry is not None else 0
        if (last or 0) != current:
            raise nats.js.errors.KeyWrongLastSequenceError(
                description=f"wrong last sequence: {current}"
            )
        return self._write(key, value, None)

    async def delete(self, key: str, last: int | None = None, **_: Any) -> bool:
        self._check()
        await asyncio.sleep(0)
        entry = self._data.entries.get(key)
        current = entry.revision if entry is not None else 0
        if last and last != current:
            # As the server answers (nats-py maps this code for updates only).
            raise nats.js.errors.BadRequestError(
                code=400, err_code=10071, description=f"wrong last sequence: {current}"
            )
        self._write(key, None, "DEL")
        return True

    def _write(self, key: str, value: bytes | None, operation: str | None) -> int:
        self._data.revision += 1
        entry = self._data.entries[key] = KeyValue.Entry(
            bucket=self.bucket,
            key=key,
            value=value,
            revision=self._data.revision,
            delta=None,
            created=None,
            operation=operation,
        )
        self._data.written.append(entry)
        return self._data.revision
