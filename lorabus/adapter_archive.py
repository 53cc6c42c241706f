"""An adapter directory as one archive: checked, packed and unpacked.

The trainer side packs an adapter directory as a plain tar whose bytes depend
only on the files (sorted paths, fixed headers), so one adapter is one
object of the fleet's store whatever machine packed it
(:mod:`lorabus.adapter_objects`); an agent unpacks it as it arrives, taking
the adapter digest on the way, and refuses anything but regular files and
directories inside its target.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from lorabus.adapter_digest import MAX_FILES

__all__ = ["check_adapter_dir", "pack", "unpack"]

_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def _files(root: Path) -> list[tuple[str, Path]]:
    """The files the adapter digest covers, as (relative path, path), in its order."""
    found: list[tuple[bytes, Path]] = []
    for folder, subfolders, names in os.walk(root, onerror=_raise):
        subfolders.sort()
        for name in names:
            path = Path(folder, name)
            if path.is_file():  # a symlink to a file counts as the file, as in the digest
                found.append((path.relative_to(root).as_posix().encode(), path))
            if len(found) > MAX_FILES:
                raise ValueError(f"{str(root)!r} holds more than {MAX_FILES} files")
    return [(relative.decode(), path) for relative, path in sorted(found)]


def _raise(error: OSError) -> None:
    raise error


def check_adapter_dir(directory: str | os.PathLike[str]) -> None:
    """ValueError, saying why, unless ``directory`` looks like a PEFT adapter."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"{str(root)!r} is not a directory")
    if not (root / "adapter_config.json").is_file():
        raise ValueError(f"{str(root)!r} has no adapter_config.json: not a PEFT adapter")
    top = [relative for relative, _ in _files(root) if "/" not in relative]
    if not any(name in _WEIGHTS or name.endswith(".safetensors") for name in top):
        raise ValueError(
            f"{str(root)!r} has no weights (adapter_model.safetensors, adapter_model.bin "
            "or another *.safetensors)"
        )


def pack(directory: str | os.PathLike[str], into: BinaryIO) -> None:
    """Write ``directory``'s files to ``into`` as an uncompressed tar whose bytes
    depend on the files only, a file at a time (an adapter can be many GB)."""
    with tarfile.open(fileobj=into, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for relative, path in _files(Path(directory)):
            with path.open("rb") as handle:
                info = tarfile.TarInfo(relative)
                info.size = os.fstat(handle.fileno()).st_size
                info.mode, info.mtime, info.uid, info.gid = 0o644, 0, 0, 0
                info.uname = info.gname = ""
                tar.addfile(info, handle)


_COPY_CHUNK = 1 << 20


def unpack(archive: str | BinaryIO, into: str) -> str | None:
    """Extract a tar made by :func:`pack` (a file, or a stream read once, front
    to back) into the empty directory ``into``, and return the adapter digest
    of what it wrote, taken as it writes (one read of the bytes fewer), or
    None when the members did not come in the digest's order (then hash
    ``into``). ValueError for anything but regular files and directories
    inside ``into``."""
    if any(os.scandir(into)):
        raise ValueError(f"{into!r} is not empty")
    digest = hashlib.sha256()
    previous: bytes | None = b""
    try:
        with _open_tar(archive) as tar:
            for count, member in enumerate(tar, start=1):
                if count > MAX_FILES:
                    raise ValueError(f"the archive holds more than {MAX_FILES} members")
                name = PurePosixPath(member.name)
                plain = member.type in (tarfile.REGTYPE, tarfile.AREGTYPE) and not member.sparse
                if not (plain or member.isdir()):
                    raise ValueError(f"archive member {member.name!r} is not a regular file")
                if name.is_absolute() or ".." in name.parts:
                    raise ValueError(f"archive member {member.name!r} points outside")
                path = os.path.join(into, *name.parts)
                if member.isdir():
                    os.makedirs(path, 0o755, exist_ok=True)
                    continue
                relative = "/".join(name.parts).encode()
                if previous is not None and relative > previous:
                    previous = relative
                    digest.update(relative + b"\0" + member.size.to_bytes(8, "big"))
                    _write_member(tar, member, path, digest)
                else:
                    previous = None  # out of order: the digest is taken from the files
                    _write_member(tar, member, path, None)
    except tarfile.TarError as exc:
        raise ValueError(f"not a valid adapter archive: {exc}") from exc
    return None if previous is None else "sha256:" + digest.hexdigest()


def _open_tar(archive: str | BinaryIO) -> tarfile.TarFile:
    if isinstance(archive, str):
        return tarfile.open(archive, mode="r:")
    return tarfile.open(fileobj=archive, mode="r|", bufsize=_COPY_CHUNK)


def _write_member(
    tar: tarfile.TarFile, member: tarfile.TarInfo, path: str, digest: hashlib._Hash | None
) -> None:
    """Write one checked member ourselves, with modes of our own: nothing of the
    archive's owners, modes or times reaches the disk (what tarfile's "data"
    filter does, which Python has only from 3.11.4 on); ``digest`` takes in
    the bytes on their way."""
    os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
    source = tar.extractfile(member)
    assert source is not None  # a regular file
    try:
        # O_EXCL: a second member of the same name is no adapter.
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError as exc:
        raise ValueError(f"archive member {member.name!r} comes twice") from exc
    with source, os.fdopen(descriptor, "wb") as target:
        while block := source.read(_COPY_CHUNK):
            if digest is not None:
                digest.update(block)
            target.write(block)
