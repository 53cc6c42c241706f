"""The content digest of an adapter directory: what proves that every replica
loads the same bytes, whatever its host's filesystem shows at the same path.

``sha256:<64 hex digits>``: SHA-256 over every regular file below the
directory (a symlink to a file counts as that file; symlinked directories
are not entered), in the byte order of their paths relative to it (``/``
separators, UTF-8), each as its relative path, a NUL byte, its size as 8
bytes big-endian, then its bytes. docs/protocol.md defines it for other
implementations.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

__all__ = ["MAX_FILES", "adapter_digest", "adapter_files", "file_header", "read_adapter_digest"]

MAX_FILES = 10_000
"""An adapter is a few files; a directory with more is not one (and hashing it
all would hold an update for nothing)."""
_CHUNK = 1 << 20


def adapter_files(directory: str | os.PathLike[str]) -> list[tuple[str, Path]]:
    """The files the digest covers, as (path relative to ``directory`` with
    ``/`` separators, path), in the digest's order: the byte order of the
    relative paths. Every regular file below ``directory`` counts, a symlink
    to a file as that file; a symlinked directory is not entered, a broken
    symlink is no file. The one walk of an adapter directory: the archive
    packs and checks exactly these files (:mod:`lorabus.adapters.archive`).
    OSError when a folder cannot be read, ValueError over MAX_FILES files."""
    root = Path(directory)
    found: list[tuple[bytes, Path]] = []
    for folder, subfolders, names in os.walk(root, onerror=_raise):
        subfolders.sort()
        for name in names:
            path = Path(folder, name)
            if path.is_file():
                found.append((path.relative_to(root).as_posix().encode(), path))
            if len(found) > MAX_FILES:
                raise ValueError(f"{str(root)!r} holds more than {MAX_FILES} files")
    return [(relative.decode(), path) for relative, path in sorted(found)]


def _raise(error: OSError) -> None:
    raise error


def file_header(relative: bytes, size: int) -> bytes:
    """What the digest takes of a file before its bytes: its relative path
    (UTF-8), a NUL byte and its size as 8 bytes big-endian."""
    return relative + b"\0" + size.to_bytes(8, "big")


def adapter_digest(directory: str | os.PathLike[str]) -> str:
    """The digest of ``directory``; raises OSError when it cannot be read and
    ValueError when it is not a directory or holds more than MAX_FILES files.
    Reads every file: on a network filesystem, async callers run it in a thread."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"{str(root)!r} is not a directory")
    digest = hashlib.sha256()
    for relative, path in adapter_files(root):
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            digest.update(file_header(relative.encode(), size))
            left = size
            while left > 0 and (chunk := handle.read(min(_CHUNK, left))):
                digest.update(chunk)
                left -= len(chunk)
            if left:
                raise OSError(f"{str(path)!r} shrank while it was read")
    return "sha256:" + digest.hexdigest()


_reading: dict[str, asyncio.Future[str]] = {}
"""Directory -> the read of its digest under way in this process."""


async def read_adapter_digest(directory: str) -> str:
    """:func:`adapter_digest` of ``directory`` in a thread (a network
    filesystem can block), one read at a time per directory in this process:
    callers that ask while a read is under way get its result, which is what a
    read of their own, made at the same time, would have seen. Agents that
    share a process (tests, the bench's agent hosts) get a broadcast load at
    the same moment; a read that starts later reads the files again. A caller
    cancelled leaves the read to the others."""
    reading = _reading.get(directory)
    if reading is None or reading.get_loop() is not asyncio.get_running_loop():
        reading = asyncio.ensure_future(asyncio.to_thread(adapter_digest, directory))
        _reading[directory] = reading
        reading.add_done_callback(lambda done: _forget(directory, done))
    return await asyncio.shield(reading)


def _forget(directory: str, done: asyncio.Future[str]) -> None:
    if _reading.get(directory) is done:
        del _reading[directory]
    if not done.cancelled():
        done.exception()  # retrieved: every waiter may have been cancelled
