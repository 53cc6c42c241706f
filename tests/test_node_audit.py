"""A node's acks in the audit trail read as its workers' own.

``audit verify`` judges each ack a ``node_acks`` record carries (a pause
that no resume follows is a violation, whoever batched it), refuses one
that claims another node than its subject's, and the timeline draws a bar
per worker from it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from click.testing import CliRunner
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from lorabus.audit.heartbeat_view import HeartbeatListener
from lorabus.audit.timeline import TimelineBuilder
from lorabus.audit.trail_file import TrailWriter
from lorabus.audit.verify import TrailRecord, verify
from lorabus.cli.main import main
from lorabus.schemas import (
    Ack,
    Heartbeat,
    LeaseExpired,
    NodeAcks,
    NodeBeats,
    Phase,
    Subjects,
    encode,
    to_builtins,
)
from lorabus.schemas.nodes import NODES_ENV, NodeRoster, encode_nodes

S = Subjects(fleet="f")


def ack(worker_id: str, phase: Phase, *, paused: bool) -> Ack:
    return Ack(
        update_id="u1",
        phase=phase,
        worker_id=worker_id,
        ok=True,
        world_size=1,
        adapters=[],
        paused=paused,
        epoch=1,
        duration_s=0.01,
    )


def record(seq: int, node: str, acks: list[Ack], *, claimed: str = "") -> TrailRecord:
    message = NodeAcks(node=claimed or node, acks=acks)
    return TrailRecord(
        seq=seq, subject=S.ack(node), ts=1000.0 + seq, kind="ack", message=to_builtins(message)
    )


def lone(seq: int, subject: str, message: object, *, kind: str = "ack") -> TrailRecord:
    return TrailRecord(
        seq=seq, subject=subject, ts=1000.0 + seq, kind=kind, message=to_builtins(message)
    )


def test_a_pause_a_node_acked_and_no_resume_followed_is_a_violation() -> None:
    paused = record(
        1, "n1", [ack("w000", Phase.PAUSE, paused=True), ack("w001", Phase.PAUSE, paused=True)]
    )
    resumed = record(2, "n1", [ack("w000", Phase.RESUME, paused=False)])

    violations = verify([paused, resumed])

    assert [(v.rule, v.seqs) for v in violations] == [("unresumed_pause", [1])]
    assert "w001" in violations[0].message


def test_a_node_message_claiming_another_node_is_a_subject_mismatch() -> None:
    forged = record(1, "n1", [ack("w000", Phase.PAUSE, paused=True)], claimed="n2")

    violations = verify([forged])

    assert [v.rule for v in violations] == ["subject_mismatch"]


def test_the_timeline_draws_each_workers_bar_from_a_nodes_acks() -> None:
    builder = TimelineBuilder()
    builder.take(
        record(
            1, "n1", [ack("w000", Phase.PAUSE, paused=True), ack("w001", Phase.PAUSE, paused=True)]
        )
    )
    builder.take(
        record(
            2,
            "n1",
            [ack("w000", Phase.RESUME, paused=False), ack("w001", Phase.RESUME, paused=False)],
        )
    )

    [timeline] = builder.timelines()
    bars = {row.worker_id: [bar.phase for bar in row.bars] for row in timeline.rows()}
    assert bars == {"w000": ["pause", "resume"], "w001": ["pause", "resume"]}
    assert not any(row.unresumed for row in timeline.rows())


def test_the_timeline_reads_the_sender_from_the_fleets_own_subject_prefix() -> None:
    acme = Subjects(fleet="f", prefix="acme")
    acks = NodeAcks(node="n1", acks=[ack("w000", Phase.PAUSE, paused=True)])
    builder = TimelineBuilder(prefix="acme")
    builder.take(
        TrailRecord(seq=1, subject=acme.ack("n1"), ts=1001.0, kind="ack", message=to_builtins(acks))
    )

    [timeline] = builder.timelines()
    assert {row.worker_id: [bar.phase for bar in row.bars] for row in timeline.rows()} == {
        "w000": ["pause"]
    }


def test_with_the_roster_the_timeline_draws_no_nodes_ack_for_another_nodes_worker() -> None:
    """A planted resume of w001 by node n1 (whose worker is w000 alone) must
    not close w001's pause on the timeline, nor draw a bar for it."""
    builder = TimelineBuilder(nodes=NodeRoster({"n1": ["w000"], "n2": ["w001"]}))
    builder.take(record(1, "n2", [ack("w001", Phase.PAUSE, paused=True)]))
    builder.take(record(2, "n1", [ack("w001", Phase.RESUME, paused=False)]))

    # Nor on its own subject, claiming to be the node of w001.
    builder.take(record(3, "n1", [ack("w001", Phase.RESUME, paused=False)], claimed="n2"))

    [timeline] = builder.timelines()
    bars = {row.worker_id: [bar.phase for bar in row.bars] for row in timeline.rows()}
    assert bars == {"w001": ["pause"]}
    assert [row.unresumed for row in timeline.rows()] == [True]


def test_the_timeline_draws_no_lone_ack_or_event_whose_body_claims_another_worker() -> None:
    """A lone agent (w000) cannot end w001's pause on the timeline either: not
    with an ack on its own subject that names w001, nor with w001's resume
    event on its own event subject."""
    paused = lone(1, S.ack("w001"), ack("w001", Phase.PAUSE, paused=True))
    resumed = LeaseExpired(
        ts=1003.0, source="agent:w001", update_id="u1", worker_id="w001", resumed=True
    )
    builder = TimelineBuilder()
    builder.take(paused)
    builder.take(lone(2, S.ack("w000"), ack("w001", Phase.RESUME, paused=False)))
    builder.take(lone(3, S.agent_event("w000", "lease_expired"), resumed, kind="event"))

    assert builder.open_pauses() == {"w001": {"u1"}}
    [timeline] = builder.timelines()
    bars = {row.worker_id: [bar.phase for bar in row.bars] for row in timeline.rows()}
    assert bars == {"w001": ["pause"]}
    assert [row.unresumed for row in timeline.rows()] == [True]

    # The same resume on w001's own subject ends it.
    builder = TimelineBuilder()
    builder.take(paused)
    builder.take(lone(3, S.agent_event("w001", "lease_expired"), resumed, kind="event"))
    assert builder.open_pauses() == {}


def test_with_the_nodes_file_a_nodes_ack_for_another_nodes_worker_is_a_mismatch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The auditor's identity names the nodes file: a node (or a lone agent
    on the ack subject of its own id) cannot plant another worker's resume
    that would hide an engine left paused."""
    paused = TrailRecord(
        seq=1, subject=S.ack("w001"), ts=1001.0, kind="ack",
        message=to_builtins(ack("w001", Phase.PAUSE, paused=True)),
    )  # fmt: skip
    planted = record(2, "n1", [ack("w001", Phase.RESUME, paused=False)])
    nodes = tmp_path / "nodes.json"
    nodes.write_bytes(encode_nodes({"n1": ["w000"]}))

    assert verify([paused, planted]) == []  # no nodes file: taken as w001's resume
    monkeypatch.setenv(NODES_ENV, str(nodes))
    rules = [v.rule for v in verify([paused, planted])]

    assert rules == ["subject_mismatch", "unresumed_pause"], rules


def test_the_printed_timeline_marks_a_nodes_ack_for_a_worker_not_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = record(1, "n1", [ack("w000", Phase.PAUSE, paused=True)])
    planted = record(2, "n1", [ack("w001", Phase.RESUME, paused=False)])
    nodes = tmp_path / "nodes.json"
    nodes.write_bytes(encode_nodes({"n1": ["w000"]}))
    monkeypatch.setenv(NODES_ENV, str(nodes))
    printed: list[str] = []

    async def tap() -> None:
        with TrailWriter(None, echo=printed.append) as writer:
            await writer.write(own)
            await writer.write(planted)

    asyncio.run(tap())

    assert "n1/w000" in printed[0] and "MISMATCH" not in printed[0], printed
    assert "MISMATCH" in printed[1] and "not one of its workers" in printed[1], printed
    assert "n1/w001" not in printed[1], "not shown as w001's own ack"


def test_status_without_a_coordinator_takes_a_nodes_beats_only_for_its_workers() -> None:
    listener = HeartbeatListener(cast(NatsClient, None), S, nodes=NodeRoster({"n1": ["w000"]}))
    beats = NodeBeats(node="n1", beats=[beat("w000"), beat("w001")])
    msg = SimpleNamespace(subject=S.heartbeat("n1"), data=encode(beats))

    asyncio.run(listener._on_heartbeat(cast(Msg, msg)))

    assert [m.worker_id for m in listener.view().members] == ["w000"]
    assert listener.view().ignored == 1


def beat(worker_id: str) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id, world_size=1, engine="dynamo", adapters=[], paused=False, interval_s=1
    )


@pytest.mark.parametrize("command", [["tap"], ["audit", "verify", "--live"]])
def test_an_unreadable_nodes_file_is_a_usage_error_before_anything_connects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    broken = tmp_path / "nodes.json"
    broken.write_text("{not json")
    monkeypatch.setenv(NODES_ENV, str(broken))

    result = CliRunner().invoke(main, [*command, "--nats", "nats://127.0.0.1:1", "--fleet", "f"])

    assert result.exit_code == 2, result.output
    assert "nodes file" in result.output and NODES_ENV in result.output
