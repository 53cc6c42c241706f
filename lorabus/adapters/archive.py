"""An adapter directory as one archive: checked, packed and unpacked.

The trainer side packs an adapter directory as a plain tar whose bytes depend
only on the files (sorted paths, fixed headers), so one adapter is one
object of the fleet's store whatever machine packed it
(:mod:`lorabus.adapters.store`); an agent unpacks it as it arrives, taking
the adapter digest on the way, and refuses anything but regular files and
directories inside its target.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tarfile
import threading
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from lorabus.adapters.digest import MAX_FILES, adapter_files, file_header

__all__ = ["AdapterChanged", "BadArchive", "Unpacker", "check_adapter_dir", "pack", "unpack"]

_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def check_adapter_dir(directory: str | os.PathLike[str]) -> None:
    """ValueError, saying why, unless ``directory`` looks like a PEFT adapter."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"{str(root)!r} is not a directory")
    if not (root / "adapter_config.json").is_file():
        raise ValueError(f"{str(root)!r} has no adapter_config.json: not a PEFT adapter")
    files = [relative for relative, _ in adapter_files(root)]
    for relative in files:
        if problem := _name_problem(relative):
            raise ValueError(f"{str(root)!r} holds {relative!r}, {problem}")
    top = [relative for relative in files if "/" not in relative]
    if not any(name in _WEIGHTS or name.endswith(".safetensors") for name in top):
        raise ValueError(
            f"{str(root)!r} has no weights (adapter_model.safetensors, adapter_model.bin "
            "or another *.safetensors)"
        )


_MAX_NAME_BYTES = 1024
_MAX_PART_BYTES = 255
_MAX_DEPTH = 32


def _name_problem(relative: str) -> str | None:
    """Why a file's path inside an adapter is refused, or None: bounded, so
    that an agent can unpack it on any filesystem (and an archive cannot
    make a tree too deep to walk)."""
    encoded, parts = relative.encode(errors="surrogateescape"), relative.split("/")
    if len(encoded) > _MAX_NAME_BYTES:
        return f"a path over {_MAX_NAME_BYTES} bytes"
    if len(parts) > _MAX_DEPTH:
        return f"a path over {_MAX_DEPTH} levels deep"
    if any(len(part.encode(errors="surrogateescape")) > _MAX_PART_BYTES for part in parts):
        return f"a path with a part over {_MAX_PART_BYTES} bytes"
    return None


class AdapterChanged(ValueError):
    """Raised when an adapter's files change while :func:`pack` reads them: a
    file grew, shrank or was rewritten, or one came or went."""


class _Hashing:
    """A file read through, its bytes added to ``digest`` as the tar copies them."""

    def __init__(self, file: BinaryIO, digest: hashlib._Hash) -> None:
        self._file, self._digest = file, digest

    def read(self, size: int = -1, /) -> bytes:
        data = self._file.read(size)
        self._digest.update(data)
        return data


def pack(directory: str | os.PathLike[str], into: BinaryIO) -> str:
    """Write ``directory``'s files to ``into`` as an uncompressed tar whose bytes
    depend on the files only, a file at a time (an adapter can be many GB),
    and return the adapter digest of exactly the bytes written: taken from
    the same reads, so an archive never goes out under a digest its bytes do
    not have (:mod:`lorabus.adapters.digest` defines it). AdapterChanged when
    a file changes, comes or goes meanwhile (a trainer still writing it)."""
    files = adapter_files(directory)
    digest = hashlib.sha256()
    with tarfile.open(fileobj=into, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for relative, path in files:
            try:
                handle = path.open("rb")
            except FileNotFoundError as exc:
                raise AdapterChanged(f"{relative!r} went away while it was packed") from exc
            with handle:
                before = os.fstat(handle.fileno())
                info = tarfile.TarInfo(relative)
                info.size = before.st_size
                info.mode, info.mtime, info.uid, info.gid = 0o644, 0, 0, 0
                info.uname = info.gname = ""
                digest.update(file_header(relative.encode(), info.size))
                try:
                    tar.addfile(info, _Hashing(handle, digest))
                except OSError as exc:
                    if os.fstat(handle.fileno()).st_size < info.size:
                        raise AdapterChanged(f"{relative!r} shrank while it was packed") from exc
                    raise
                after = os.fstat(handle.fileno())
                if _version(after) != _version(before) or handle.read(1):
                    raise AdapterChanged(f"{relative!r} changed while it was packed")
    if [relative for relative, _ in adapter_files(directory)] != [r for r, _ in files]:
        raise AdapterChanged("its files changed while it was packed (one came or went)")
    return "sha256:" + digest.hexdigest()


def _version(stat: os.stat_result) -> tuple[int, int, int]:
    """What changes when a file is written: its size, its modification and change times."""
    return stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


_BLOCK = tarfile.BLOCKSIZE
_READ_CHUNK = 1 << 20
_MAX_PAX_BYTES = 64 << 10
"""More extended header than any name of an adapter's files needs."""
_MAX_MEMBER_BYTES = 1 << 63
"""The digest writes each file's size in 8 bytes."""


class BadArchive(ValueError):
    """What was unpacked is no archive :func:`pack` could have made."""


class Unpacker:
    """Unpacks a tar made by :func:`pack` into the empty directory ``into`` as
    its bytes are written, in order, taking the adapter digest on the way.

    Member data goes from each written chunk straight to its file and its
    hash (no copy): tarfile's stream reader joins and slices every block it
    reads, a third of a fetch's unpacking CPU. tarfile still parses each
    header. Only regular files and directories inside ``into`` are written,
    with modes of our own (nothing of the archive's owners, modes or times
    reaches the disk); anything else raises :class:`BadArchive`, which also
    ends the unpacking. ``write`` may be called from any thread, one call at
    a time; :meth:`close` waits for a call under way."""

    def __init__(self, into: str) -> None:
        if any(os.scandir(into)):
            raise ValueError(f"{into!r} is not empty")
        self._into = into
        self._lock = threading.Lock()
        self._gathered = bytearray()
        """A header block, or an extended header, as its bytes come."""
        self._want = _BLOCK
        self._pax: dict[str, str] | None = None
        """The extended header that applies to the next member."""
        self._pax_size = 0
        self._data_left = 0
        self._skip = 0
        """Padding still to pass, after a member's data."""
        self._file: int | None = None
        self._hashing: hashlib._Hash | None = None
        self._members = 0
        self._digest = hashlib.sha256()
        self._previous: bytes | None = b""
        """The last file's path, while members come in the digest's order."""
        self._ended = self._closed = False

    def write(self, data: bytes | memoryview, /) -> int:
        with self._lock:
            if self._closed:
                raise BadArchive("the unpacking has stopped")
            try:
                self._take(memoryview(data))
            except BaseException:
                self._close_file()
                self._closed = True
                raise
        return len(data)

    def finish(self) -> str | None:
        """End the unpacking: the adapter digest of what was written, or None
        when the members did not come in the digest's order (then hash the
        directory). BadArchive when the archive stopped inside a member."""
        with self._lock:
            self._closed = True
            self._close_file()
            if self._gathered or self._data_left or self._pax_size or self._pax is not None:
                raise BadArchive("the archive is cut short")
            return None if self._previous is None else "sha256:" + self._digest.hexdigest()

    def close(self) -> None:
        """Stop, keeping nothing open (the caller removes ``into``)."""
        with self._lock:
            self._closed = True
            self._close_file()

    def _take(self, view: memoryview) -> None:
        while view and not self._ended:
            if self._data_left:
                piece = view[: self._data_left]
                if self._hashing is not None:
                    self._hashing.update(piece)
                _write_all(self._file, piece)
                self._data_left -= len(piece)
                view = view[len(piece) :]
                if not self._data_left:
                    self._close_file()
            elif self._skip:
                passed = min(self._skip, len(view))
                self._skip -= passed
                view = view[passed:]
            else:
                wanted = self._want - len(self._gathered)
                self._gathered += view[:wanted]
                view = view[wanted:]
                if len(self._gathered) == self._want:
                    gathered, self._gathered = bytes(self._gathered), bytearray()
                    if self._pax_size:
                        self._extended(gathered)
                    else:
                        self._header(gathered)

    def _header(self, block: bytes) -> None:
        if block == bytes(_BLOCK):  # the end: what follows is padding
            self._ended = True
            return
        try:
            member = tarfile.TarInfo.frombuf(block, "utf-8", "strict")
        except (tarfile.HeaderError, ValueError) as exc:
            raise BadArchive(f"not a valid adapter archive: {exc}") from exc
        if member.type == tarfile.XHDTYPE:
            if self._pax is not None or not 0 < member.size <= _MAX_PAX_BYTES:
                raise BadArchive("not a valid adapter archive: a bad extended header")
            self._pax_size, self._want = member.size, _padded(member.size)
            return
        pax, self._pax = self._pax or {}, None
        self._members += 1
        if self._members > MAX_FILES:
            raise BadArchive(f"the archive holds more than {MAX_FILES} members")
        name, size = _checked_member(member, pax)
        path = os.path.join(self._into, *name.parts)
        if member.type == tarfile.DIRTYPE:  # tarfile's parse made "name/" one too
            if size:
                raise BadArchive(f"archive member {str(name)!r} is a directory with data")
            _make_dirs(path, name)
        else:
            self._open_member(path, name, size)

    def _open_member(self, path: str, name: PurePosixPath, size: int) -> None:
        """Create the file of a regular member, its data to follow, and take
        it into the digest while members come in the digest's order."""
        _make_dirs(os.path.dirname(path), name)
        try:
            # O_EXCL: a second member of the same name is no adapter.
            self._file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except (FileExistsError, NotADirectoryError) as exc:
            raise BadArchive(f"archive member {str(name)!r} comes twice") from exc
        relative = "/".join(name.parts).encode()
        if self._previous is not None and relative > self._previous:
            self._previous = relative
            self._digest.update(file_header(relative, size))
            self._hashing = self._digest
        else:
            self._previous = self._hashing = None  # out of order: hash the files
        self._data_left, self._skip = size, _padded(size) - size
        if not size:
            self._close_file()

    def _extended(self, gathered: bytes) -> None:
        records = _pax_records(gathered[: self._pax_size])
        if any(key.startswith("GNU.sparse") for key in records):
            raise BadArchive("archive member is sparse, not a regular file")
        self._pax, self._pax_size, self._want = records, 0, _BLOCK

    def _close_file(self) -> None:
        if self._file is not None:
            os.close(self._file)
            self._file = None


def _checked_member(member: tarfile.TarInfo, pax: dict[str, str]) -> tuple[PurePosixPath, int]:
    """The name and size of an archive member (its extended header's, if it
    had one); BadArchive unless it is a regular file or a directory, of a
    bounded name and size, inside the target."""
    name = PurePosixPath(pax.get("path", member.name))
    size = _pax_size(pax, member.size)
    # tarfile parses GNU's base-256 sizes, negative and huge ones too.
    if not 0 <= size < _MAX_MEMBER_BYTES:
        raise BadArchive(f"archive member {str(name)!r} has a size of {size}")
    if "\0" in str(name):
        raise BadArchive(f"archive member {str(name)!r} has a NUL in its name")
    if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE):
        raise BadArchive(f"archive member {str(name)!r} is not a regular file")
    if name.is_absolute() or ".." in name.parts or not name.parts:
        raise BadArchive(f"archive member {str(name)!r} points outside")
    if problem := _name_problem("/".join(name.parts)):
        raise BadArchive(f"archive member {str(name)[:64]!r}... has {problem}")
    return name, size


def _make_dirs(path: str, name: PurePosixPath) -> None:
    try:
        os.makedirs(path, 0o755, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:  # a file has the folder's name
        raise BadArchive(f"archive member {str(name)!r} comes twice") from exc


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def _write_all(descriptor: int | None, data: memoryview) -> None:
    assert descriptor is not None  # a member's data goes to its open file
    while data:
        data = data[os.write(descriptor, data) :]


def _pax_size(pax: dict[str, str], size: int) -> int:
    if "size" not in pax:
        return size
    if not re.fullmatch(r"[0-9]{1,20}", pax["size"]):
        raise BadArchive(f"not a valid adapter archive: size {pax['size'][:32]!r}")
    return int(pax["size"])


def _pax_records(data: bytes) -> dict[str, str]:
    """The records of a POSIX extended header: ``"<length> <key>=<value>\\n"``."""
    records: dict[str, str] = {}
    at = 0
    while at < len(data):
        space = data.find(b" ", at)
        length = data[at:space] if space >= 0 else b""
        if not re.fullmatch(rb"[0-9]{1,6}", length) or not space < at + int(length) <= len(data):
            raise BadArchive("not a valid adapter archive: a bad extended header")
        record, at = data[space + 1 : at + int(length)], at + int(length)
        key, equals, value = record.removesuffix(b"\n").partition(b"=")
        if not equals or not record.endswith(b"\n"):
            raise BadArchive("not a valid adapter archive: a bad extended header")
        try:
            records[key.decode()] = value.decode()
        except UnicodeDecodeError as exc:
            raise BadArchive(f"not a valid adapter archive: {exc}") from exc
    return records


def unpack(archive: str | BinaryIO, into: str) -> str | None:
    """Extract a tar made by :func:`pack` (a file, or a stream read once, front
    to back) into the empty directory ``into``; what :meth:`Unpacker.finish`
    returns. BadArchive (a ValueError) for anything but regular files and
    directories inside ``into``."""
    unpacker = Unpacker(into)
    with contextlib.ExitStack() as closing:
        closing.callback(unpacker.close)
        source = closing.enter_context(open(archive, "rb")) if isinstance(archive, str) else archive
        while chunk := source.read(_READ_CHUNK):
            unpacker.write(chunk)
        return unpacker.finish()
