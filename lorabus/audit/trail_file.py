"""Audit trails on disk: one JSON object per line, as ``lorabus tap --out`` writes.

Writing appends and flushes each line before the tap reads on, so a record
is either on disk or read again: a restarted tap starts after the last
sequence the file holds, skipping what it already has.

Reading trusts the file no more than the wire: each line is decoded by a
bounded reader, and a line that is no trail record (not JSON, the wrong
shape, nesting too deep, too long) is reported with its line number, and
reading goes on. A trail is read whole (:func:`read_trail`) or a line at a
time (:func:`trail_items`, which keeps nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import msgspec

from lorabus.audit.tap import timeline_line
from lorabus.audit.verify import TrailRecord, poison_text
from lorabus.schemas import MAX_MESSAGE_BYTES, BadPayload, Reader, any_decoder
from lorabus.schemas.nodes import NodeRoster

MAX_LINE_BYTES = 2 * MAX_MESSAGE_BYTES
"""The longest line read: a record holds one message of at most
MAX_MESSAGE_BYTES, plus its sequence, subject and time."""

_reader: Reader[TrailRecord] = Reader(TrailRecord, max_bytes=MAX_LINE_BYTES)
_encoder = msgspec.json.Encoder()


class BadLine(msgspec.Struct, frozen=True, kw_only=True):
    """A line of a trail file that is no trail record."""

    number: int
    error: str
    """Why, with its size and an escaped excerpt."""
    seq: int | None = None
    subject: str | None = None
    """The sequence and subject the line claims, when it can be read that far."""

    def describe(self, path: str | Path) -> str:
        said = [f"record {self.seq}"] if self.seq is not None else []
        said += [f"on {self.subject!r}"] if self.subject is not None else []
        claims = f" ({' '.join(said)})" if said else ""
        return f"line {self.number} of {path}{claims}: {self.error}"


class Trail(msgspec.Struct, frozen=True, kw_only=True):
    """What a trail file holds: its records, and the lines that are none."""

    records: list[TrailRecord]
    bad_lines: list[BadLine]


def read_trail(path: str | Path) -> Trail:
    records: list[TrailRecord] = []
    bad_lines: list[BadLine] = []
    for item in trail_items(path):
        if isinstance(item, BadLine):
            bad_lines.append(item)
        else:
            records.append(item)
    return Trail(records=records, bad_lines=bad_lines)


def trail_items(path: str | Path) -> Iterator[TrailRecord | BadLine]:
    """Each line of a trail file, read when asked for: a record, or a line
    that is none (an empty line is skipped)."""
    with open(path, "rb") as lines:
        for number, line in _numbered_lines(lines):
            if not line.strip():
                continue
            try:
                yield _reader.decode(line)
            except BadPayload as exc:
                seq, subject = _claims(line)
                error = poison_text(f"not a trail record: {exc}", line)
                yield BadLine(number=number, error=error, seq=seq, subject=subject)


def _claims(line: bytes) -> tuple[int | None, str | None]:
    """The sequence and subject a broken line names, if it is a JSON object."""
    try:
        value = any_decoder.decode(line)
    except BadPayload:
        return None, None
    if not isinstance(value, dict):
        return None, None
    seq, subject = value.get("seq"), value.get("subject")
    return (
        seq if isinstance(seq, int) and not isinstance(seq, bool) else None,
        subject[:256] if isinstance(subject, str) else None,
    )


def _numbered_lines(lines: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """Each line with its number; a line over MAX_LINE_BYTES is cut there (and
    so fails to decode) without ever holding more of it in memory."""
    number = 0
    while True:
        line = lines.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        number += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (rest := lines.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass
        yield number, line


def last_seq_in(path: str | Path) -> int:
    """The highest sequence already in ``path`` (0 when it does not exist)."""
    with contextlib.suppress(FileNotFoundError):
        return max((record.seq for record in read_trail(path).records), default=0)
    return 0


class TrailWriter:
    """Appends records to a file, or prints them as a timeline when there is none."""

    def __init__(
        self, path: str | Path | None, echo: Callable[[str], None], nodes: NodeRoster | None = None
    ) -> None:
        """``nodes``: which workers each node may ack for, marked in the
        printed timeline (by default ``$LORABUS_NODES_FILE``'s, else any; a
        file gets every record as it came, so it needs none)."""
        self.path = path
        self.echo = echo
        if nodes is None and path is None:
            nodes = NodeRoster.from_env()
        self._nodes = nodes
        self._file: IO[bytes] | None = None
        self._update: str | None = None

    def __enter__(self) -> TrailWriter:
        if self.path is not None:
            self._file = open(self.path, "ab")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._file is not None:
            self._file.close()

    async def write(self, record: TrailRecord) -> None:
        if self._file is None:
            line, self._update = timeline_line(record, self._update, self._nodes)
            self.echo(line)
            return
        self._file.write(_encoder.encode(record) + b"\n")
        self._file.flush()
