"""``lorabus audit timeline --live`` reads the updates it draws, not the
stream (issue 39).

The audit stream may hold a GiB of earlier updates. The live timeline finds
where the updates asked for start (walking the coordinator's
``update_started`` and ``update_finished`` events back from the end) and
reads from there; a pause still open where an update's records end is
followed on its worker's own subjects. Each test fills a real stream with a
trail of many updates, reads it through a reader that notes every record it
returns, and checks two things: the timelines are the ones the whole trail
gives (as ``audit timeline FILE`` draws them), and what was read is the
drawn updates' records plus a bounded number of others.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import pytest
from nats.aio.client import Client as NatsClient
from secured import watched

from lorabus.audit.tap import StreamReader, Tap
from lorabus.audit.timeline import build_timelines
from lorabus.audit.timeline_sources import from_stream
from lorabus.audit.verify import TrailRecord
from lorabus.bus.connect import close, connect
from lorabus.coordinator.config import StorageConfig
from lorabus.coordinator.streams import fleet_streams
from lorabus.errors import AuditStreamMissing
from lorabus.schemas import (
    Ack,
    EngineResumed,
    LeaseExpired,
    Phase,
    PhaseFinished,
    Subjects,
    UpdateFinished,
    UpdateStarted,
    build_rank_map,
    encode,
    tag_of,
)
from lorabus.security.roles import Role
from lorabus.testbed.stack import EmbeddedStack

WORKERS = ("w0", "w1", "w2", "w3")
_RESUMES = ("engine_resumed", "lease_expired")
"""An agent's own resumes: its events that end a pause."""
DEADLINE_S = 30.0


class NotingReader(StreamReader):
    """A reader that notes the sequence of every record it returns."""

    def __init__(self, nc: NatsClient, subjects: Subjects) -> None:
        super().__init__(nc, subjects)
        self.seqs: list[int] = []

    async def batch(self, start: dict[str, object], limit: int = 256) -> list[TrailRecord]:
        return self._noted(await super().batch(start, limit))

    async def next_on(self, subject: str, seq: int, limit: int) -> list[TrailRecord]:
        return self._noted(await super().next_on(subject, seq, limit))

    async def last_on(self, subject: str, up_to_seq: int) -> TrailRecord | None:
        found = await super().last_on(subject, up_to_seq)
        return self._noted([found])[0] if found is not None else None

    def _noted(self, records: list[TrailRecord]) -> list[TrailRecord]:
        self.seqs += [record.seq for record in records]
        return records


@dataclass
class Stream:
    """A fleet's audit stream on the test's nats-server, filled by hand."""

    nc: NatsClient
    subjects: Subjects
    stored: list[tuple[int, msgspec.Struct]] = field(default_factory=list)
    """(sequence, message) of every record published."""

    async def add(self, messages: Sequence[msgspec.Struct]) -> list[int]:
        """Publish ``messages`` where their senders do; their sequences."""
        js, seqs = self.nc.jetstream(), []
        for message in messages:
            ack = await js.publish(_subject(self.subjects, message), encode(message))
            self.stored.append((ack.seq, message))
            seqs.append(ack.seq)
        return seqs

    async def everything(self) -> list[TrailRecord]:
        records: list[TrailRecord] = []

        async def keep(record: TrailRecord) -> None:
            records.append(record)

        await Tap(self.nc, self.subjects).run(keep, follow=False)
        return records

    def entries(self) -> set[int]:
        """The sequences of the coordinator's update_started and update_finished."""
        kinds = (UpdateStarted, UpdateFinished)
        return {seq for seq, message in self.stored if isinstance(message, kinds)}

    def reader(self) -> NotingReader:
        return NotingReader(self.nc, self.subjects)


@pytest.fixture
async def stream(nats_url: str, fleet_name: str) -> AsyncIterator[Stream]:
    subjects = Subjects(fleet=fleet_name)
    nc = await connect(nats_url, name="test-live-timeline")
    try:
        audit = fleet_streams(StorageConfig(fleet=fleet_name))[-1]
        # Stored with an answer here, so that the test learns each record's sequence.
        await nc.jetstream().add_stream(dataclasses.replace(audit, no_ack=False))
        yield Stream(nc, subjects)
    finally:
        await nc.jetstream().delete_stream(subjects.audit_stream())
        await close(nc)


def _subject(subjects: Subjects, message: msgspec.Struct) -> str:
    if isinstance(message, Ack):
        return subjects.ack(message.worker_id)
    source = getattr(message, "source", "coordinator")
    if source == "coordinator":
        return subjects.coordinator_event(tag_of(message))
    return subjects.agent_event(source.removeprefix("agent:"), tag_of(message))


def _ack(worker: str, phase: Phase, update: str) -> Ack:
    return Ack(
        update_id=update,
        phase=phase,
        worker_id=worker,
        ok=True,
        world_size=1,
        adapters=[],
        paused=phase is not Phase.RESUME,
        duration_s=0.001,
        epoch=1,
        instance=f"i-{worker}",
    )


def _event(message: type[msgspec.Struct], **fields: object) -> msgspec.Struct:
    return message(ts=0.0, source="coordinator", epoch=1, **fields)


def _finished(update: str, workers: Sequence[str] = ()) -> msgspec.Struct:
    rank_map = build_rank_map(dict.fromkeys(workers, 1)) if workers else None
    return _event(UpdateFinished, update_id=update, status="committed", rank_map=rank_map)


def _update(
    update: str, workers: Sequence[str] = WORKERS, *, unresumed: Sequence[str] = ()
) -> list[msgspec.Struct]:
    """One update as its coordinator and agents leave it in the trail: a
    pause, a load and a resume of each worker (none of ``unresumed``)."""
    members = dict.fromkeys(workers, 1)
    messages = [
        _event(UpdateStarted, update_id=update, adapter="policy", version=1, members=members)
    ]
    for phase in (Phase.PAUSE, Phase.LOAD, Phase.RESUME):
        acking = [w for w in workers if phase is not Phase.RESUME or w not in unresumed]
        messages += [_ack(w, phase, update) for w in acking]
        messages.append(
            _event(PhaseFinished, update_id=update, phase=phase.value, ok=True, duration_s=0.01)
        )
    return [*messages, _finished(update, workers)]


async def test_the_last_update_is_read_alone_however_many_came_before(stream: Stream) -> None:
    for n in range(40):
        await stream.add(_update(f"u{n:02d}"))
    drawn = await stream.add(_update("last"))
    reader = stream.reader()

    selection = await from_stream(reader, (), 1)

    whole = build_timelines(await stream.everything())
    assert [t.update_id for t in whole] == [f"u{n:02d}" for n in range(40)] + ["last"]
    assert selection.timelines == whole[-1:]
    assert set(drawn) <= set(reader.seqs)
    others = set(reader.seqs) - set(drawn)
    assert len(others) <= 1 and others <= stream.entries(), "an earlier update's first record"
    assert reader.records_read == len(reader.seqs) <= len(drawn) + 3, reader.seqs


async def test_the_last_k_are_read_from_the_kth_start_with_requests_that_never_ran(
    stream: Stream,
) -> None:
    """A request answered without running (busy, refused) shows as its
    ``update_finished`` alone, and counts as an update, as in a file."""
    for n in range(30):
        await stream.add(_update(f"u{n:02d}"))
    busy = _finished("busy-1")
    run = _update("u30")
    drawn = await stream.add([*run[:3], busy, *run[3:], *_update("u31"), _finished("bad-1")])
    reader = stream.reader()

    selection = await from_stream(reader, (), 4)

    whole = build_timelines(await stream.everything())
    assert [t.update_id for t in selection.timelines] == ["u30", "busy-1", "u31", "bad-1"]
    assert selection.timelines == whole[-4:]
    others = set(reader.seqs) - set(drawn)
    assert set(drawn) <= set(reader.seqs) and others <= stream.entries() and len(others) <= 1
    assert len(reader.seqs) <= len(drawn) + 2 * 4 + 1, "and their first and last ones again"


async def test_an_older_update_is_read_alone_and_its_open_pauses_followed(
    stream: Stream,
) -> None:
    """In u10, w1 and w2 are not resumed by their resume acks and w3 is never
    heard from again: u11's resume resumes w1, w2's agent resumes it when its
    lease runs out, and nothing resumes w3, whose pause runs to the stream's
    last record. Nothing of the later updates is read but their first
    records and the paused workers' own few."""
    for n in range(10):
        await stream.add(_update(f"u{n:02d}"))
    drawn = await stream.add(_update("u10", unresumed=("w1", "w2", "w3")))
    living = ("w0", "w1", "w2")
    u11 = _update("u11", living)
    lease = LeaseExpired(
        ts=0.0, source="agent:w2", epoch=1, update_id="u10", worker_id="w2", resumed=True
    )
    await stream.add([u11[0], lease, *u11[1:]])
    for n in range(12, 30):
        await stream.add(_update(f"u{n:02d}", living))
    await stream.add([EngineResumed(ts=0.0, source="agent:w0", worker_id="w0", reason="start")])
    reader = stream.reader()

    selection = await from_stream(reader, ["u10"], 1)

    whole = build_timelines(everything := await stream.everything())
    (u10,) = selection.timelines
    assert u10 == next(t for t in whole if t.update_id == "u10")
    pauses = {w: row.pause for w, row in u10.workers.items()}
    assert pauses["w0"] is not None and pauses["w0"].resumed_by == "its resume"
    assert pauses["w1"] is not None and pauses["w1"].resumed_by == "the resume of update u11"
    assert pauses["w2"] is not None and "lease" in pauses["w2"].resumed_by
    assert [row.worker_id for row in u10.unresumed] == ["w3"]
    assert pauses["w3"] is not None and pauses["w3"].end == everything[-1].ts
    subjects = stream.subjects
    followed = {subjects.ack(w) for w in ("w1", "w2", "w3")}
    followed |= {subjects.agent_event(w, k) for w in ("w1", "w2", "w3") for k in _RESUMES}
    by_seq = {record.seq: record.subject for record in everything}
    others = [seq for seq in reader.seqs if seq not in drawn]
    probed = [seq for seq in others if by_seq[seq] in followed]
    walked = [seq for seq in others if seq in stream.entries()]
    assert others[-1] == everything[-1].seq, "the trail's end: its last record"
    assert sorted(others[:-1]) == sorted(walked + probed), "nothing else"
    assert len(walked) <= 2 * 20 + 1, "the first and last records of each later update"
    assert len(probed) <= 2 * 8, "a few records of each paused worker"


async def test_what_the_stream_does_not_show_is_said_as_a_file_says_it(stream: Stream) -> None:
    """An unknown id names the updates the stream shows; a stream whose limits
    dropped an update's start still draws what is left of it; asking for more
    updates than there are reads them all; an empty stream holds none."""
    empty = await from_stream(stream.reader(), (), 1)
    head = [_ack(w, phase, "cut") for phase in (Phase.LOAD, Phase.RESUME) for w in WORKERS]
    await stream.add([*head, _finished("cut", WORKERS)])
    for n in range(3):
        await stream.add(_update(f"u{n}"))
    await stream.add([_finished("refused")])

    unknown = await from_stream(stream.reader(), ["u1", "nope"], 1)
    cut = await from_stream(stream.reader(), ["cut"], 1)
    every = await from_stream(stream.reader(), (), 10)

    whole = build_timelines(await stream.everything())
    assert empty.timelines == [] and empty.shown == []
    assert unknown.unknown == ["nope"] and unknown.timelines == []
    assert unknown.shown == [t.update_id for t in whole]
    assert cut.timelines == [whole[0]] and whole[0].update_id == "cut"
    assert every.timelines == whole


async def test_a_fleet_without_an_audit_stream_is_said_at_once(
    nats_url: str, fleet_name: str
) -> None:
    nc = await connect(nats_url, name="test-live-timeline")
    try:
        with pytest.raises(AuditStreamMissing):
            await from_stream(StreamReader(nc, Subjects(fleet=fleet_name)), (), 1)
    finally:
        await close(nc)


async def test_the_auditor_draws_an_earlier_update_by_direct_gets_alone(
    secured_stack: EmbeddedStack, make_adapter: Callable[[int], str]
) -> None:
    """The auditor may read the audit stream only by direct gets (no
    consumer): finding an update and following its pauses asks for nothing
    more."""
    assert secured_stack.client is not None
    first = await secured_stack.client.update("policy", make_adapter(1), version=1)
    second = await secured_stack.client.update("policy", make_adapter(2), version=2)
    assert first.committed and second.committed, (first, second)
    subjects = Subjects(fleet=secured_stack.fleet_name)

    async with watched(secured_stack.bus_as(Role.AUDITOR)) as auditor:
        async with asyncio.timeout(DEADLINE_S):
            selection = await from_stream(StreamReader(auditor.nc, subjects), [first.update_id], 1)
        assert auditor.refusals() == []

    (timeline,) = selection.timelines
    assert timeline.status == "committed" and set(timeline.workers) == {"w000", "w001"}
    assert timeline.unresumed == []
