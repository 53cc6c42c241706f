"""A node agent (agents/node.py) on the in-memory bus, with the real agents
and coordinator: its workers' acks go out batched on the node's subject and
count as each worker's own; a worker refused its id stops alone; anything
else that ends a worker's agent ends the node, every worker with it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from convergence_helpers import member_until
from memory_bus import MemoryServer
from memory_fleet import HEARTBEAT_S, InMemoryFleet

from lorabus.agents.node import NodeOutbox
from lorabus.schemas import (
    Ack,
    Phase,
    RefuseInstance,
    Subjects,
    ack_message_decoder,
    beat_message_decoder,
    reports_of,
)

pytestmark = pytest.mark.looptime

NODE = {"n0w0": 1, "n0w1": 2, "n0w2": 1}
DEADLINE_S = 30.0


async def _members(fleet: InMemoryFleet, workers: list[str]) -> None:
    await fleet.coordinator.membership.wait_quorum(
        sum(fleet.world_sizes.get(w, 0) for w in workers) + sum(NODE.values()), DEADLINE_S
    )


async def test_a_nodes_acks_come_batched_and_count_as_each_workers_own() -> None:
    fleet = InMemoryFleet({"w000": 1}, expected_world_size=1 + sum(NODE.values()))
    async with fleet:
        _, task = fleet.start_node("n0", NODE)
        await _members(fleet, ["w000"])

        result = await fleet.client().update("policy", "/adapters/policy/1", version=1)
        assert not task.done()

    assert result.committed, result.error
    assert result.rank_map is not None
    sizes = {e.worker_id: e.world_size for e in result.rank_map.entries}
    assert sizes == {"w000": 1, **NODE}
    assert {a.worker_id for a in fleet.acks} == {"w000", *NODE}
    node_acks = [
        reports_of(ack_message_decoder.decode(data))
        for subject, data in fleet.server.published
        if subject == fleet.subjects.ack("n0")
    ]
    acked = [ack for batch in node_acks for ack in batch]
    # Every worker's ack of each phase came from the node, never on its own subject.
    for worker_id in NODE:
        assert {a.phase for a in acked if a.worker_id == worker_id} >= {Phase.RESUME}
        assert not any(s == fleet.subjects.ack(worker_id) for s, _ in fleet.server.published)
    assert len(node_acks) < len(acked), "the node's workers answered in batches"


async def test_a_worker_refused_its_id_stops_alone_and_the_node_serves_on() -> None:
    fleet = InMemoryFleet({"n0w1": 2}, expected_world_size=sum(NODE.values()))
    async with fleet:
        lone = fleet.agents["n0w1"]
        node, task = fleet.start_node("n0", NODE)
        refused = next(a for a in node.agents if a.worker_id == "n0w1")
        client = fleet.client()
        for worker_id in ("n0w0", "n0w2"):
            await member_until(client, worker_id, lambda m: m.ready)
        # The coordinator refuses the newer of two agents with one worker id.
        async with asyncio.timeout(DEADLINE_S):
            while True:
                sent = [c for _, c in fleet.commands if isinstance(c, RefuseInstance)]
                if any(c.instance == refused.instance for c in sent):
                    break
                await asyncio.sleep(0.1)

        refused_at = len(fleet.server.published)
        result = await client.update("policy", "/adapters/policy/1", version=1)
        await asyncio.sleep(5 * HEARTBEAT_S)

        assert not task.done(), "the node's other workers go on"
        assert lone.ready
        # The refused agent stopped: nothing of it comes from its node any more.
        spoken = [
            report
            for subject, data in fleet.server.published[refused_at:]
            if subject in (fleet.subjects.ack("n0"), fleet.subjects.heartbeat("n0"))
            for report in _reports(subject, data, fleet)
        ]
        assert {r.worker_id for r in spoken} == {"n0w0", "n0w2"}, spoken
        assert refused.instance not in {r.instance for r in spoken}

    assert result.committed, result.error
    assert {w for w, o in result.workers.items() if o.ok} == set(NODE)


async def test_any_other_failure_of_a_worker_ends_the_node_and_every_worker() -> None:
    fleet = InMemoryFleet({"w000": 1}, expected_world_size=1)
    async with fleet:
        node, task = fleet.start_node("n0", NODE)
        broken = node.agents[1]
        serve = broken._serve
        bug = asyncio.Event()

        async def serve_until_a_bug(*args: object) -> None:
            # A bug in one worker's agent, once it serves: nothing handles it.
            serving = asyncio.ensure_future(serve(*args))  # type: ignore[arg-type]
            await bug.wait()
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            raise RuntimeError("a bug in n0w1's agent")

        broken._serve = serve_until_a_bug  # type: ignore[method-assign]
        await _members(fleet, ["w000"])
        bug.set()

        with pytest.raises(RuntimeError, match="a bug in n0w1"):
            async with asyncio.timeout(DEADLINE_S):
                await asyncio.shield(task)
        # Its node-mates' heartbeats stopped with it: the coordinator counts them gone.
        async with asyncio.timeout(DEADLINE_S):
            while True:
                status = await fleet.client().status()
                if {m.worker_id for m in status.members} == {"w000"}:
                    break
                await asyncio.sleep(0.2)
        beats_after = len(fleet.server.published)
        await asyncio.sleep(1.0)
        from_node = [s for s, _ in fleet.server.published[beats_after:] if s.endswith(".n0")]

    assert from_node == [], "no worker of the node still speaks"


async def test_a_node_stopped_mid_send_still_sends_what_it_held() -> None:
    server = MemoryServer()
    nc = server.connect("n0")
    publish, hung = nc.publish, asyncio.Event()

    async def first_send_hangs(subject: str, payload: bytes = b"", **kw: Any) -> None:
        if not hung.is_set():
            hung.set()
            await asyncio.Event().wait()  # until the node stops
        await publish(subject, payload, **kw)

    nc.publish = first_send_hangs  # type: ignore[method-assign]
    subjects, outbox, running = _running_outbox(nc)
    resumed = _ack("u1", Phase.RESUME)
    outbox.put(resumed)
    await asyncio.wait_for(hung.wait(), DEADLINE_S)

    running.cancel()
    await asyncio.gather(running, return_exceptions=True)

    sent = [
        ack
        for subject, data in server.published
        if subject == subjects.ack("n0")
        for ack in reports_of(ack_message_decoder.decode(data))
    ]
    assert sent == [resumed], "the resume ack in hand when the node stopped went out"


async def test_a_report_counts_as_sent_only_once_it_is_published() -> None:
    """An ack that never left must not let the worker skip its next beat
    (agents/beats.py): the outbox says a report is sent when it is published."""
    server = MemoryServer()
    nc = server.connect("n0")
    publish, failing, refused = nc.publish, True, asyncio.Event()

    async def publish_fails_while_asked(subject: str, payload: bytes = b"", **kw: Any) -> None:
        if failing:
            refused.set()
            raise ConnectionError("connection closed")
        await publish(subject, payload, **kw)

    nc.publish = publish_fails_while_asked  # type: ignore[method-assign]
    _, outbox, running = _running_outbox(nc)
    told: list[str] = []
    sent = asyncio.Event()
    try:
        lost = _ack("u1", Phase.LOAD)
        outbox.put(lost, lambda: told.append("lost"))
        await asyncio.wait_for(refused.wait(), DEADLINE_S)
        await asyncio.sleep(0)  # the outbox goes on past the failed publish
        assert told == [], "a report whose publish failed was counted as sent"

        failing = False
        outbox.put(_ack("u2", Phase.LOAD), lambda: (told.append("sent"), sent.set()))
        await asyncio.wait_for(sent.wait(), DEADLINE_S)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    assert told == ["sent"]
    assert [
        a.update_id for _, d in server.published for a in reports_of(ack_message_decoder.decode(d))
    ] == ["u2"]


def _running_outbox(nc: Any) -> tuple[Subjects, NodeOutbox, asyncio.Task[None]]:
    """Node n0's outbox on ``nc``, for its one worker, running."""
    subjects = Subjects(fleet="f")
    outbox = NodeOutbox(nc, subjects, "n0")
    outbox.track("n0w0", lambda: True)
    return subjects, outbox, asyncio.create_task(outbox.run())


def _ack(update_id: str, phase: Phase) -> Ack:
    return Ack(
        update_id=update_id, phase=phase, worker_id="n0w0", ok=True, world_size=1,
        adapters=[], paused=False, epoch=1, duration_s=0.01,
    )  # fmt: skip


def _reports(subject: str, data: bytes, fleet: InMemoryFleet) -> list[Any]:
    """The workers' acks or beats of a node's message."""
    if subject == fleet.subjects.ack("n0"):
        return reports_of(ack_message_decoder.decode(data))
    return reports_of(beat_message_decoder.decode(data))
