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

import hashlib
import os
from pathlib import Path

__all__ = ["MAX_FILES", "adapter_digest"]

MAX_FILES = 10_000
"""An adapter is a few files; a directory with more is not one (and hashing it
all would hold an update for nothing)."""
_CHUNK = 1 << 20


def adapter_digest(directory: str | os.PathLike[str]) -> str:
    """The digest of ``directory``; raises OSError when it cannot be read and
    ValueError when it is not a directory or holds more than MAX_FILES files.
    Reads every file: on a network filesystem, async callers run it in a thread."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"{str(root)!r} is not a directory")
    files: list[tuple[bytes, Path]] = []
    for folder, subfolders, names in os.walk(root, onerror=_raise):
        subfolders.sort()
        for name in names:
            path = Path(folder, name)
            if path.is_file():
                files.append((path.relative_to(root).as_posix().encode(), path))
            if len(files) > MAX_FILES:
                raise ValueError(f"{str(root)!r} holds more than {MAX_FILES} files")
    digest = hashlib.sha256()
    for relative, path in sorted(files):
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            digest.update(relative + b"\0" + size.to_bytes(8, "big"))
            left = size
            while left > 0 and (chunk := handle.read(min(_CHUNK, left))):
                digest.update(chunk)
                left -= len(chunk)
            if left:
                raise OSError(f"{str(path)!r} shrank while it was read")
    return "sha256:" + digest.hexdigest()


def _raise(error: OSError) -> None:
    raise error
