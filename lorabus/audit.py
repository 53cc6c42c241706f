"""Checking a fleet's audit trail against lorabus's promises.

A trail is what the audit stream captured (commands, acks, events), in stream
order; ``lorabus tap --out`` writes it as JSON lines. ``verify`` replays it
and reports every place where a promise was broken, with the records that
show it:

- ``unresumed_pause``: an engine paused (ok pause ack) that neither a resume
  ack, nor a lease expiry, nor a resume by a restarting agent followed;
- ``load_not_acked``: a committed update serving a member that never acked
  the load ok;
- ``stale_epoch_acted``: an agent acting on (acking ok) a command of an older
  epoch than one it had already seen;
- ``rank_map_mismatch``: a committed rank map that does not follow from the
  update's membership (order, offsets, sizes, group size);
- ``no_terminal_result``: an update that started and never finished.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from lorabus.schemas import (
    COMMITTED,
    Ack,
    Command,
    CommandRefused,
    EngineResumed,
    Event,
    LeaseExpired,
    Phase,
    UpdateFinished,
    UpdateStarted,
)


class TrailRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One captured message: its stream sequence and subject, and the message."""

    seq: int
    subject: str
    ts: float
    """When the stream stored it (Unix time)."""
    kind: str
    """``command``, ``ack`` or ``event``."""
    message: dict[str, Any]


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    rule: str
    message: str
    seqs: list[int]
    """Stream sequences of the records that show it."""


_command = msgspec.json.Decoder(Command)
_ack = msgspec.json.Decoder(Ack)
_event = msgspec.json.Decoder(Event)
_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "command": _command,
    "ack": _ack,
    "event": _event,
}


def decode_message(record: TrailRecord) -> Any:
    return _DECODERS[record.kind].decode(msgspec.json.encode(record.message))


def verify(records: Iterable[TrailRecord]) -> list[Violation]:
    checker = _Checker()
    for record in sorted(records, key=lambda r: r.seq):
        try:
            message = decode_message(record)
        except (msgspec.DecodeError, KeyError):
            continue  # not ours to judge (a malformed message is reported elsewhere)
        checker.feed(record.seq, message)
    return checker.finish()


class _Checker:
    def __init__(self) -> None:
        self.violations: list[Violation] = []
        self.open_pauses: dict[tuple[str, str], int] = {}
        """(worker, update) -> seq of the ok pause ack not yet undone."""
        self.load_acks: dict[tuple[str, str], int] = {}
        self.highest_epoch: dict[str, tuple[int, int]] = {}
        """worker -> (highest epoch it acted on or saw, seq that shows it)."""
        self.started: dict[str, tuple[UpdateStarted, int]] = {}

    def feed(self, seq: int, message: Any) -> None:
        match message:
            case Ack():
                self._ack(seq, message)
            case UpdateStarted():
                self.started[message.update_id] = (message, seq)
            case UpdateFinished():
                self._finished(seq, message)
            case LeaseExpired(resumed=True):
                self.open_pauses.pop((message.worker_id, message.update_id), None)
            case EngineResumed():
                for key in [k for k in self.open_pauses if k[0] == message.worker_id]:
                    del self.open_pauses[key]
            case CommandRefused():
                self._saw_epoch(message.worker_id, message.epoch_seen, seq)

    def _ack(self, seq: int, ack: Ack) -> None:
        if ack.ok:
            highest, shown_at = self.highest_epoch.get(ack.worker_id, (0, 0))
            if ack.epoch < highest:
                self.violations.append(
                    Violation(
                        rule="stale_epoch_acted",
                        message=f"{ack.worker_id} acted on {ack.phase} of update "
                        f"{ack.update_id} at epoch {ack.epoch} after seeing epoch {highest}",
                        seqs=[shown_at, seq],
                    )
                )
            self._saw_epoch(ack.worker_id, ack.epoch, seq)
        key = (ack.worker_id, ack.update_id)
        match ack.phase:
            case Phase.PAUSE if ack.ok:
                self.open_pauses.setdefault(key, seq)
            case Phase.RESUME if ack.ok:
                # A resume of any update un-pauses the engine.
                for open_key in [k for k in self.open_pauses if k[0] == ack.worker_id]:
                    del self.open_pauses[open_key]
            case Phase.LOAD if ack.ok:
                self.load_acks[key] = seq

    def _saw_epoch(self, worker: str, epoch: int, seq: int) -> None:
        if epoch > self.highest_epoch.get(worker, (0, 0))[0]:
            self.highest_epoch[worker] = (epoch, seq)

    def _finished(self, seq: int, finished: UpdateFinished) -> None:
        started = self.started.pop(finished.update_id, None)
        if finished.status != COMMITTED or finished.rank_map is None:
            return
        rank_map = finished.rank_map
        for entry in rank_map.entries:
            if (entry.worker_id, finished.update_id) not in self.load_acks:
                self.violations.append(
                    Violation(
                        rule="load_not_acked",
                        message=f"update {finished.update_id} committed with "
                        f"{entry.worker_id}, which never acked its load",
                        seqs=[seq],
                    )
                )
        problem = _rank_map_problem(finished, started[0] if started else None)
        if problem:
            self.violations.append(
                Violation(
                    rule="rank_map_mismatch",
                    message=f"update {finished.update_id}: {problem}",
                    seqs=[started[1], seq] if started else [seq],
                )
            )

    def finish(self) -> list[Violation]:
        for (worker, update_id), seq in sorted(self.open_pauses.items(), key=lambda i: i[1]):
            self.violations.append(
                Violation(
                    rule="unresumed_pause",
                    message=f"{worker} paused for update {update_id} and was never resumed",
                    seqs=[seq],
                )
            )
        for update_id, (_, seq) in sorted(self.started.items(), key=lambda i: i[1][1]):
            self.violations.append(
                Violation(
                    rule="no_terminal_result",
                    message=f"update {update_id} started and never finished",
                    seqs=[seq],
                )
            )
        return self.violations


def _rank_map_problem(finished: UpdateFinished, started: UpdateStarted | None) -> str:
    rank_map = finished.rank_map
    assert rank_map is not None
    ids = [entry.worker_id for entry in rank_map.entries]
    if ids != sorted(ids):
        return f"workers are not in worker-id order: {ids}"
    expected_offset = 1
    for entry in rank_map.entries:
        if entry.rank_offset != expected_offset:
            return (
                f"{entry.worker_id} has rank offset {entry.rank_offset}, expected {expected_offset}"
            )
        if started is not None and started.members.get(entry.worker_id) != entry.world_size:
            return (
                f"{entry.worker_id} has world size {entry.world_size} in the rank map but "
                f"{started.members.get(entry.worker_id)} in the membership"
            )
        expected_offset += entry.world_size
    if rank_map.world_size != expected_offset:
        return f"group world size {rank_map.world_size}, expected {expected_offset}"
    return ""
