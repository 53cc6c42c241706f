"""Reading a fleet's audit stream: live, or replayed from a time or sequence.

The coordinator creates the stream; the tap only reads it, through a durable
pull consumer that it acknowledges after each record is written, so a tap
that stops (or a nats-server that restarts) resumes where it left off. A
redelivered record (written, but its ack lost) is recognised by its stream
sequence and not written twice.

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
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from lorabus.audit import (
    TrailRecord,
    decode_message,
    origin_of,
    poison_text,
    read_payload,
    subject_problem,
)
from lorabus.cancellation import raise_if_cancelled
from lorabus.errors import AuditStreamMissing
from lorabus.render import printable
from lorabus.schemas import BadPayload, Subjects, tag_of, to_builtins

log = logging.getLogger(__name__)

_BATCH = 256
_FETCH_WAIT_S = 1.0

Sink = Callable[[TrailRecord], Awaitable[None]]


def to_record(msg: Msg, subjects: Subjects) -> TrailRecord:
    """The record of one stored message; a malformed payload makes a poison record."""
    meta = msg.metadata
    origin = origin_of(msg.subject, subjects.prefix)
    message: dict[str, object] = {}
    poison = ""
    try:
        message = to_builtins(read_payload(origin, msg.data))
    except BadPayload as exc:
        poison = poison_text(f"not a valid {origin.kind} message: {exc}", msg.data)
    return TrailRecord(
        seq=meta.sequence.stream,
        subject=msg.subject,
        ts=meta.timestamp.timestamp() if meta.timestamp else 0.0,
        kind=origin.kind,
        message=message,
        poison=poison,
    )


class Tap:
    def __init__(
        self,
        nc: NatsClient,
        subjects: Subjects,
        *,
        durable: str | None = None,
        start_seq: int | None = None,
        start_time: dt.datetime | None = None,
        after_seq: int = 0,
    ) -> None:
        """``durable`` names a consumer that remembers its position across runs;
        ``after_seq`` skips records up to that sequence (already written)."""
        self.nc = nc
        self.subjects = subjects
        self.durable = durable
        self.start_seq = start_seq
        self.start_time = start_time
        self.last_seq = after_seq

    async def run(self, sink: Sink, *, follow: bool) -> int:
        """Write records to ``sink`` until caught up (or, following, until cancelled)."""
        js = self.nc.jetstream()
        stream = self.subjects.audit_stream()
        await self._until_stream(js, stream, follow)
        sub = await js.pull_subscribe_bind(
            stream=stream,
            durable=self.durable,
            name=await self._consumer(js, stream),
        )
        try:
            return await self._drain_into(sub, sink, follow)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _until_stream(self, js: Any, stream: str, follow: bool) -> None:
        """Return once ``stream`` exists. A tap that follows waits for it (started
        beside a fleet, it may come up before the coordinator or the operator's
        set-up has created it, or before JetStream answers); a replay raises
        AuditStreamMissing at once."""
        if not follow:
            try:
                await js.stream_info(stream)
            except nats.js.errors.NotFoundError as exc:
                raise AuditStreamMissing(
                    f"fleet {self.subjects.fleet!r} has no audit stream {stream!r} yet: "
                    "a coordinator (or lorabus provision) creates it"
                ) from exc
            return
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

    async def _drain_into(self, sub: Any, sink: Sink, follow: bool) -> int:
        written = 0
        pause = 0.1
        while True:
            raise_if_cancelled()
            try:
                if not follow and (await sub.consumer_info()).num_pending == 0:
                    return written
                batch = await sub.fetch(batch=_BATCH, timeout=_FETCH_WAIT_S)
                pause = 0.1
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                # The bus is away (a restart): the durable consumer keeps our place.
                log.warning("tap: %s; retrying in %.1fs", exc, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 5.0)
                continue
            for msg in batch:
                record = to_record(msg, self.subjects)
                if record.seq > self.last_seq:
                    await sink(record)
                    self.last_seq = record.seq
                    written += 1
                await msg.ack()

    async def _consumer(self, js: object, stream: str) -> str:
        extra: dict[str, object] = {}
        if self.start_seq is not None:
            policy, extra = DeliverPolicy.BY_START_SEQUENCE, {"opt_start_seq": self.start_seq}
        elif self.start_time is not None:
            policy, extra = (
                DeliverPolicy.BY_START_TIME,
                {"opt_start_time": self.start_time.astimezone(dt.UTC).isoformat()},
            )
        else:
            policy = DeliverPolicy.ALL
        config = ConsumerConfig(
            durable_name=self.durable,
            name=self.durable,
            deliver_policy=policy,
            ack_policy=AckPolicy.EXPLICIT,
            inactive_threshold=None if self.durable else 60.0,
            **extra,  # type: ignore[arg-type]
        )
        if self.durable:
            try:
                await js.consumer_info(stream, self.durable)  # type: ignore[attr-defined]
                return self.durable  # keep its position: this is a resumed tap
            except nats.js.errors.NotFoundError:
                pass
        info = await js.add_consumer(stream, config=config)  # type: ignore[attr-defined]
        return str(info.name)


def timeline_line(record: TrailRecord, previous_update: str | None) -> tuple[str, str | None]:
    """One human-readable line (with a header when the update changes), escaped.

    Who sent a record is what its subject says; a body that claims otherwise
    is marked."""
    when = dt.datetime.fromtimestamp(record.ts).strftime("%H:%M:%S.%f")[:-3]
    subject = printable(repr(record.subject))
    try:
        message = decode_message(record)
    except BadPayload as exc:
        return f"{when} {record.seq:>7} POISON {subject}: {printable(str(exc))}", previous_update
    origin = origin_of(record.subject)
    update_id = getattr(message, "update_id", None) or previous_update
    sender = origin.worker if origin.kind != "command" else None
    who = sender or "coordinator"
    epoch = getattr(message, "epoch", 0)
    detail = _detail(record.message)
    problem = subject_problem(origin, message)
    if problem:
        detail = f"MISMATCH ({problem}) {detail}"
    line = printable(f"{when} {record.seq:>7} e{epoch} {who:<18} {tag_of(message):<16} {detail}")
    if update_id != previous_update and update_id:
        line = f"-- update {printable(update_id)} --\n{line}"
    return line, update_id


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
