"""Audit trails on disk: one JSON object per line, as ``lorabus tap --out`` writes.

Writing appends and flushes each line before the tap acknowledges it, so a
record is either on disk or will be delivered again; reading back the last
sequence lets a restarted tap skip what the file already holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import IO

import msgspec

from lorabus.audit import TrailRecord
from lorabus.tap import timeline_line

_decoder = msgspec.json.Decoder(TrailRecord)
_encoder = msgspec.json.Encoder()


def read_trail(path: str | Path) -> list[TrailRecord]:
    records = []
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                records.append(_decoder.decode(line))
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{number}: not a trail record: {exc}") from exc
    return records


def last_seq_in(path: str | Path) -> int:
    """The highest sequence already in ``path`` (0 when it does not exist)."""
    with contextlib.suppress(FileNotFoundError):
        return max((record.seq for record in read_trail(path)), default=0)
    return 0


class TrailWriter:
    """Appends records to a file, or prints them as a timeline when there is none."""

    def __init__(self, path: str | Path | None, echo: Callable[[str], None]) -> None:
        self.path = path
        self.echo = echo
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
            line, self._update = timeline_line(record, self._update)
            self.echo(line)
            return
        self._file.write(_encoder.encode(record) + b"\n")
        self._file.flush()
