"""Reading a fleet's audit stream: live, or replayed from a time or sequence.

The coordinator (or ``lorabus provision``) creates the stream; the tap only
reads it, a batch of stored messages at a time by sequence (JetStream's
direct get, through :class:`StreamReader`, which also finds the last or the
next record on a subject), and polls for more when it has caught up. It
creates no consumer: a consumer's deliver subject would let whoever may
create one have JetStream publish stored commands wherever it names
(docs/security.md). Its
place is the last sequence it wrote: a tap appending to a trail file starts
after the file's last record, so a tap that stops (or a nats-server that
restarts) goes on where it left off, writing nothing twice. A read that
gets no answer is tried again for as long as the bus is away
(:func:`~lorabus.bus.connect.until_answered`: said once, then once a minute).

No message can stop the tap: each payload is read by the wire contract's
reader for its subject, and one that is not a valid message (not JSON, the
wrong shape, an unknown type, numbers out of range, nesting too deep, over
the size limit) becomes a *poison* record, with its sequence, subject,
reason, size and an escaped excerpt, and the tap goes on. A good record
holds the message as lorabus reads it (unknown fields dropped), so what the
trail holds is always readable again. Printed text escapes whatever came off
the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
    wait_exponential,
)

from lorabus.audit.render import printable
from lorabus.audit.verify import (
    TrailRecord,
    decode_message,
    origin_of,
    poison_text,
    read_payload,
    subject_problem,
)
from lorabus.bus.connect import is_transient, js_api_of, until_answered
from lorabus.errors import AuditStreamMissing, BusError
from lorabus.runtime.cancellation import raise_if_cancelled
from lorabus.schemas import BadPayload, NodeAcks, Subjects, tag_of, to_builtins
from lorabus.schemas.nodes import NodeRoster

log = logging.getLogger(__name__)

_T = TypeVar("_T")

BATCH = 256
"""The most records one direct get answers with."""
_BATCH_MAX_BYTES = 4 * 1024 * 1024
"""A batch stops at this many bytes, so that messages of up to a MiB each
arrive within the deadline of each message on a slow link."""
_READ_DEADLINE_S = 5.0
"""How long the next message of a batch may take."""
_CAUGHT_UP_POLL_S = 0.5
"""How often a following tap that has caught up asks for more."""

Sink = Callable[[TrailRecord], Awaitable[None]]


def to_record(msg: Msg, subjects: Subjects) -> TrailRecord:
    """The record of one stored message, as a direct get returns it (its
    subject, sequence and time in headers); a malformed payload makes a poison
    record."""
    headers = msg.headers or {}
    subject = headers.get("Nats-Subject", "")
    origin = origin_of(subject, subjects.prefix)
    message: dict[str, object] = {}
    poison = ""
    try:
        message = to_builtins(read_payload(origin, msg.data))
    except BadPayload as exc:
        poison = poison_text(f"not a valid {origin.kind} message: {exc}", msg.data)
    return TrailRecord(
        seq=int(headers.get("Nats-Sequence", "0")),
        subject=subject,
        ts=_stored_at(headers.get("Nats-Time-Stamp", "")),
        kind=origin.kind,
        message=message,
        poison=poison,
    )


def _stored_at(stamp: str) -> float:
    """Seconds since the epoch of a ``Nats-Time-Stamp`` (RFC 3339, nanoseconds)."""
    if not stamp:
        return 0.0
    head, _, rest = stamp.rstrip("Z").partition(".")
    fraction = "".join(c for c in rest if c.isdigit())[:6]
    when = dt.datetime.fromisoformat(head).replace(tzinfo=dt.UTC)
    return when.timestamp() + (int(fraction.ljust(6, "0")) / 1e6 if fraction else 0.0)


class StreamReader:
    """The audit stream, read by direct gets: a batch of stored records from a
    sequence or a time, the next records or the last one on a subject, and the
    sequences the stream holds. It creates no consumer. A read that gets no
    answer is tried again while the bus is away; ``records_read`` counts the
    records it returned."""

    def __init__(self, nc: NatsClient, subjects: Subjects, *, who: str = "") -> None:
        self.nc = nc
        self.subjects = subjects
        self.who = who or f"reader of fleet {subjects.fleet}"
        self.records_read = 0

    async def stored(self) -> range:
        """The sequences the stream holds (empty: none); AuditStreamMissing
        when the fleet has no audit stream."""
        stream = self.subjects.audit_stream()

        async def info() -> Any:
            try:
                return await self.nc.jetstream().stream_info(stream)
            except nats.js.errors.NotFoundError as exc:
                raise AuditStreamMissing(
                    f"fleet {self.subjects.fleet!r} has no audit stream {stream!r} yet: "
                    "a coordinator (or lorabus provision) creates it"
                ) from exc

        state = (await self._answered(info)).state
        return range(state.first_seq, state.last_seq + 1) if state.messages else range(0)

    async def batch(self, start: dict[str, object], limit: int = BATCH) -> list[TrailRecord]:
        """Up to ``limit`` records from ``start`` (``{"seq": N}`` or
        ``{"start_time": ...}``) on; none: caught up."""
        return await self._get({**start, "batch": limit})

    async def next_on(self, subject: str, seq: int, limit: int) -> list[TrailRecord]:
        """Up to ``limit`` records on ``subject`` from sequence ``seq`` on."""
        return await self._get({"next_by_subj": subject, "seq": seq, "batch": limit})

    async def last_on(self, subject: str, up_to_seq: int) -> TrailRecord | None:
        """The last record on ``subject`` at or before sequence ``up_to_seq``."""
        if up_to_seq < 1:  # 0 would ask for no bound at all
            return None
        found = await self._get({"multi_last": [subject], "up_to_seq": up_to_seq, "batch": 1})
        return found[0] if found else None

    async def _get(self, request: dict[str, object]) -> list[TrailRecord]:
        msgs = await self._answered(partial(self._direct_get, request))
        records = [to_record(msg, self.subjects) for msg in msgs]
        self.records_read += len(records)
        return records

    async def _answered(self, call: Callable[[], Awaitable[_T]]) -> _T:
        # The bus may be away (a restart): the read is tried again once it answers.
        return await until_answered(
            call,
            who=self.who,
            doing=f"reading the audit stream {self.subjects.audit_stream()}",
            retry=retry_if_exception(is_transient),
        )

    async def _direct_get(self, request: dict[str, object]) -> list[Msg]:
        """The stored messages a direct get answers ``request`` with."""
        api = f"{js_api_of(self.nc)}.DIRECT.GET.{self.subjects.audit_stream()}"
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        try:
            request = {**request, "max_bytes": _BATCH_MAX_BYTES}
            await self.nc.publish(api, msgspec.json.encode(request), reply=inbox)
            found: list[Msg] = []
            while True:
                try:
                    msg = await sub.next_msg(timeout=_READ_DEADLINE_S)
                except nats.errors.TimeoutError:
                    if found:  # keep what came: the next read starts after it
                        return found
                    raise
                status = (msg.headers or {}).get("Status", "")
                if not status:
                    found.append(msg)
                elif status in ("204", "404"):  # the batch's end; nothing (more) stored
                    return found
                elif status == "503":
                    raise BusError(
                        f"the audit stream {self.subjects.audit_stream()} does not allow "
                        "direct reads: run lorabus provision (as the operator) once more"
                    )
                else:
                    description = (msg.headers or {}).get("Description", "")
                    raise nats.errors.Error(f"reading the audit stream: {status} {description}")
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


class Tap:
    def __init__(
        self,
        nc: NatsClient,
        subjects: Subjects,
        *,
        start_seq: int | None = None,
        start_time: dt.datetime | None = None,
        after_seq: int = 0,
    ) -> None:
        """``after_seq`` skips records up to that sequence (already written)."""
        self.nc = nc
        self.subjects = subjects
        self.start_seq = start_seq
        self.start_time = start_time
        self.last_seq = after_seq

    async def run(self, sink: Sink, *, follow: bool) -> int:
        """Write records to ``sink`` until caught up (or, following, until cancelled)."""
        reader = StreamReader(self.nc, self.subjects, who=f"tap of fleet {self.subjects.fleet}")
        if follow:
            await self._until_stream(self.nc.jetstream(), self.subjects.audit_stream())
        else:
            await reader.stored()  # a replay says at once that there is no stream
        written = 0
        start: dict[str, object] = {"seq": max(self.last_seq + 1, self.start_seq or 1)}
        if self.start_time is not None and not self.last_seq:
            start = {"start_time": self.start_time.astimezone(dt.UTC).isoformat()}
        while True:
            raise_if_cancelled()
            batch = await reader.batch(start)
            for record in batch:
                if record.seq > self.last_seq:
                    await sink(record)
                    self.last_seq = record.seq
                    written += 1
            if batch:
                start = {"seq": self.last_seq + 1}
            elif not follow:
                return written
            else:
                await asyncio.sleep(_CAUGHT_UP_POLL_S)

    async def _until_stream(self, js: Any, stream: str) -> None:
        """Return once ``stream`` exists: a tap that follows waits for it
        (started beside a fleet, it may come up before the coordinator or the
        operator's set-up has created it, or before JetStream answers)."""
        said = False

        def say_once(state: RetryCallState) -> None:
            nonlocal said
            if not said and state.outcome is not None:
                log.warning(
                    "tap: cannot follow the audit stream %s yet (%s); waiting for it "
                    "(a coordinator or lorabus provision creates it)",
                    stream,
                    state.outcome.exception() or "no answer",
                )
                said = True

        # No stop: following means waiting as long as it takes, until cancelled.
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type((nats.errors.Error, nats.js.errors.Error, TimeoutError)),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            before_sleep=say_once,
        ):
            with attempt:
                await js.stream_info(stream)
        if said:
            log.info("tap: the audit stream %s is there: following it", stream)


def timeline_line(
    record: TrailRecord, previous_update: str | None, nodes: NodeRoster | None = None
) -> tuple[str, str | None]:
    """One human-readable line (with a header when the update changes), escaped.

    Who sent a record is what its subject says; a body that claims otherwise
    is marked, and so is a node's ack for a worker that ``nodes`` (the
    roster, when there is one) does not give it."""
    when = dt.datetime.fromtimestamp(record.ts).strftime("%H:%M:%S.%f")[:-3]
    subject = printable(repr(record.subject))
    try:
        message = decode_message(record)
    except BadPayload as exc:
        return f"{when} {record.seq:>7} POISON {subject}: {printable(str(exc))}", previous_update
    origin = origin_of(record.subject)
    problem = subject_problem(origin, message, nodes)
    if isinstance(message, NodeAcks) and not problem:
        return _node_lines(record, message, when, previous_update)
    update_id = getattr(message, "update_id", None) or previous_update
    sender = origin.worker if origin.kind != "command" else None
    who = sender or "coordinator"
    epoch = getattr(message, "epoch", 0)
    detail = _detail(record.message)
    if problem:
        detail = f"MISMATCH ({problem}) {detail}"
    line = printable(f"{when} {record.seq:>7} e{epoch} {who:<18} {tag_of(message):<16} {detail}")
    if update_id != previous_update and update_id:
        line = f"-- update {printable(update_id)} --\n{line}"
    return line, update_id


def _node_lines(
    record: TrailRecord, message: NodeAcks, when: str, previous_update: str | None
) -> tuple[str, str | None]:
    """A node's acks as a line each, by ``<node>/<worker>``."""
    lines = []
    acks = [a for a in record.message.get("acks", []) if isinstance(a, dict)]
    for ack, body in zip(message.acks, acks, strict=False):
        who = f"{message.node}/{ack.worker_id}"
        line = printable(
            f"{when} {record.seq:>7} e{ack.epoch} {who:<18} {'ack':<16} {_detail(body)}"
        )
        if ack.update_id != previous_update:
            line = f"-- update {printable(ack.update_id)} --\n{line}"
            previous_update = ack.update_id
        lines.append(line)
    return "\n".join(lines), previous_update


def _detail(message: dict[str, object]) -> str:
    skip = {"type", "v", "ts", "source", "update_id", "worker_id", "epoch", "targets"}
    parts = []
    for key, value in message.items():
        if key in skip or value in (None, [], {}, ""):
            continue
        if isinstance(value, dict) and "message" in value:
            value = value["message"]
        parts.append(f"{key}={value}")
    return " ".join(parts)[:300]
