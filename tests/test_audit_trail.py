"""The audit stream records every command, ack and event; the tap reads it back
without losing or repeating a record, across a nats-server restart too."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from lorabus.audit.tap import Tap
from lorabus.audit.trail_file import TrailWriter, last_seq_in
from lorabus.audit.verify import TrailRecord, decode_message, verify
from lorabus.bus.connect import close, connect
from lorabus.schemas import Ack, Subjects, UpdateFinished, UpdateStarted
from lorabus.testbed.natsserver import NatsServer
from lorabus.testbed.stack import EmbeddedStack


async def _replay(url: str, fleet: str, trail: Path | None = None) -> list[TrailRecord]:
    """The records a tap writes; appended to ``trail`` after its last one, as
    ``lorabus tap --out`` does."""
    nc = await connect(url, name="test-tap")
    records: list[TrailRecord] = []

    async def sink(record: TrailRecord) -> None:
        records.append(record)
        if writer is not None:
            await writer.write(record)

    after = last_seq_in(str(trail)) if trail is not None else 0
    writer = TrailWriter(str(trail), echo=print) if trail is not None else None
    try:
        with writer or contextlib.nullcontext():
            await asyncio.wait_for(
                Tap(nc, Subjects(fleet=fleet), after_seq=after).run(sink, follow=False), 30
            )
    finally:
        await close(nc)
    return records


async def test_the_trail_of_committed_updates_holds_every_step_and_verifies_clean(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([2, 1]) as stack:
        assert stack.client is not None
        for step in (1, 2):
            assert (await stack.client.update("policy", make_adapter(step), version=step)).committed
        records = await _replay(nats_url, fleet_name)

    messages = [decode_message(r) for r in records]
    assert [r.poison for r in records if r.poison] == []
    assert [r.seq for r in records] == sorted(r.seq for r in records)
    assert {r.kind for r in records} == {"command", "ack", "event"}
    started = [m for m in messages if isinstance(m, UpdateStarted)]
    finished = [m for m in messages if isinstance(m, UpdateFinished)]
    assert len(started) == 2 and len(finished) == 2
    assert all(m.epoch >= 1 for m in started + finished)
    assert all(f.rank_map is not None for f in finished)
    acks = [m for m in messages if isinstance(m, Ack)]
    # A quick load's ack carries its pause's (wire version 4).
    assert {(a.worker_id, a.phase) for a in acks if a.with_pause} >= {("w000", "load")}
    acked = {(a.worker_id, a.phase) for a in acks}
    assert acked | {(a.worker_id, "pause") for a in acks if a.with_pause} >= {
        ("w000", "pause"),
        ("w000", "load"),
        ("w000", "resume"),
        ("w001", "load"),
    }
    assert verify(records) == []


@pytest.fixture
async def own_server() -> AsyncIterator[NatsServer]:
    with tempfile.TemporaryDirectory(prefix="lorabus-js-") as store:
        server = NatsServer(store_dir=store)
        await server.start()
        try:
            yield server
        finally:
            server.stop()


async def test_a_tap_writing_a_trail_resumes_after_a_restart_without_losing_or_repeating(
    own_server: NatsServer, fleet_name: str, make_adapter: Callable[[int], str], tmp_path: Path
) -> None:
    trail = tmp_path / "trail.jsonl"
    async with EmbeddedStack(
        [1, 1], fleet=fleet_name, nats_url=own_server.url, heartbeat_s=0.2
    ) as stack:
        assert stack.client is not None
        assert (await stack.client.update("policy", make_adapter(1), version=1)).committed
        first = await _replay(own_server.url, fleet_name, trail)
        own_server.stop()
        await own_server.start()
        result = await stack.client.update("policy", make_adapter(2), version=2, timeout_s=30)
        second = await _replay(own_server.url, fleet_name, trail)

    assert result.committed, result.error
    seqs = [r.seq for r in first + second]
    assert len(seqs) == len(set(seqs)), "no record written twice"
    assert seqs == list(range(1, len(seqs) + 1)), "no record lost"
    assert any(isinstance(decode_message(r), UpdateFinished) for r in second)
