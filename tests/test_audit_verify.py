"""`audit verify` finds each broken promise in a trail, and nothing in a clean one."""

from __future__ import annotations

import msgspec
import pytest

from lorabus.audit import TrailRecord, verify
from lorabus.schemas import (
    Ack,
    CommandRefused,
    EngineResumed,
    LeaseExpired,
    Phase,
    RankEntry,
    RankMap,
    UpdateFinished,
    UpdateStarted,
    build_rank_map,
    to_builtins,
)

MEMBERS = {"a": 2, "b": 1}


def _trail(*messages: msgspec.Struct) -> list[TrailRecord]:
    records = []
    for seq, message in enumerate(messages, start=1):
        kind = "ack" if isinstance(message, Ack) else "event"
        records.append(
            TrailRecord(
                seq=seq,
                subject=f"lorabus.f.{kind}",
                ts=float(seq),
                kind=kind,
                message=to_builtins(message),
            )
        )
    return records


def _ack(worker: str, phase: Phase, update: str = "u1", *, ok: bool = True, epoch: int = 1) -> Ack:
    return Ack(
        update_id=update,
        phase=phase,
        worker_id=worker,
        ok=ok,
        world_size=MEMBERS[worker],
        adapters=[],
        paused=phase is Phase.PAUSE,
        epoch=epoch,
    )


def _started(update: str = "u1") -> UpdateStarted:
    return UpdateStarted(
        ts=0,
        source="coordinator",
        update_id=update,
        adapter="p-v1",
        version=1,
        members=MEMBERS,
        epoch=1,
    )


def _finished(
    update: str = "u1", rank_map: RankMap | None = None, status: str = "committed"
) -> UpdateFinished:
    if rank_map is None and status == "committed":
        rank_map = build_rank_map(MEMBERS)
    return UpdateFinished(
        ts=0, source="coordinator", update_id=update, status=status, rank_map=rank_map, epoch=1
    )


def _clean_update(update: str = "u1") -> list[msgspec.Struct]:
    return [
        _started(update),
        *(_ack(w, Phase.PAUSE, update) for w in MEMBERS),
        *(_ack(w, Phase.LOAD, update) for w in MEMBERS),
        *(_ack(w, Phase.RESUME, update) for w in MEMBERS),
        _finished(update),
    ]


def _rules(*messages: msgspec.Struct) -> list[str]:
    return [violation.rule for violation in verify(_trail(*messages))]


def test_a_clean_trail_has_no_violations() -> None:
    assert _rules(*_clean_update("u1"), *_clean_update("u2")) == []


def test_a_pause_never_resumed_is_found_with_the_record_that_shows_it() -> None:
    trail = _trail(
        _started(),
        _ack("a", Phase.PAUSE),
        _ack("b", Phase.PAUSE),
        _ack("a", Phase.RESUME),
        _finished(status="failed"),
    )
    violations = verify(trail)

    assert [v.rule for v in violations] == ["unresumed_pause"]
    assert "b" in violations[0].message and violations[0].seqs == [3]


@pytest.mark.parametrize(
    "undo",
    [
        LeaseExpired(ts=0, source="agent:b", update_id="u1", worker_id="b", resumed=True),
        EngineResumed(ts=0, source="agent:b", worker_id="b", reason="agent start"),
    ],
)
def test_a_lease_expiry_or_a_restart_resume_counts_as_resumed(undo: msgspec.Struct) -> None:
    assert _rules(_started(), _ack("b", Phase.PAUSE), undo, _finished(status="failed")) == []


def test_a_committed_member_without_a_load_ack_is_found() -> None:
    messages = [
        m
        for m in _clean_update()
        if not (isinstance(m, Ack) and m.worker_id == "b" and m.phase is Phase.LOAD)
    ]
    assert _rules(*messages) == ["load_not_acked"]


def test_acting_on_an_older_epoch_than_seen_is_found() -> None:
    refused = CommandRefused(
        ts=0,
        source="agent:a",
        update_id="u2",
        worker_id="a",
        command="pause",
        epoch=1,
        epoch_seen=3,
    )
    assert _rules(*_clean_update(), refused, _ack("a", Phase.RESUME, "u2", epoch=2)) == [
        "stale_epoch_acted"
    ]


def test_a_rank_map_that_does_not_follow_from_the_membership_is_found() -> None:
    wrong = RankMap(
        world_size=4,
        membership_version="x",
        entries=[
            RankEntry(worker_id="a", world_size=2, rank_offset=1),
            RankEntry(worker_id="b", world_size=1, rank_offset=2),
        ],
    )
    messages = [*_clean_update()[:-1], _finished(rank_map=wrong)]
    assert _rules(*messages) == ["rank_map_mismatch"]


def test_an_update_that_never_finished_is_found() -> None:
    assert _rules(*_clean_update()[:-1]) == ["no_terminal_result"]
