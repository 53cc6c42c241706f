"""The adapter digest and the archive see the same files, in the same order:
one walk (:func:`adapter_files`) with one symlink rule serves both, so a
push is never stored under a digest the agents' reading of the same
directory does not give.

The tree has what a walk can get wrong: a symlink to a file (counted as
that file), symlinks to directories (never entered), a broken symlink, nested
folders, and names whose byte order is not the order of their components
(``a.txt`` before ``a/b.txt``, which sorting ``Path`` objects reverses) nor
of UTF-16 (``\\ufffd`` before an emoji, which Java or JavaScript strings
reverse). Each is checked against docs/protocol.md's definition, written out
again here.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from lorabus.adapters.archive import check_adapter_dir, pack, unpack
from lorabus.adapters.digest import adapter_digest, adapter_files

#: Relative path -> bytes of every file the digest must cover.
FILES = {
    "adapter_config.json": b'{"r": 8}',
    "adapter_model.safetensors": b"\x01" * 4096,
    "a.txt": b"beside the folder a",
    "a/b.txt": b"inside the folder a",
    "a-b.txt": b"a dash sorts before a slash",
    "Z.txt": b"capitals sort first",
    "\u00e9.txt": b"two bytes of UTF-8",
    "\ufffd.txt": b"three bytes of UTF-8, after an emoji in UTF-16",
    "\U0001f600.txt": b"four bytes of UTF-8",
    "nested/deeper/weights.bin": b"\x00" * 3,
    "nested/empty": b"",
}
#: Symlinks to files, counted as the file they point to.
LINKED_FILES = {
    "linked_from_outside.bin": b"a file outside the adapter",
    "nested/linked_sibling": FILES["nested/deeper/weights.bin"],
}


@pytest.fixture
def adapter(tmp_path: Path) -> Path:
    root = tmp_path / "adapter"
    for relative, data in FILES.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_bytes(data)
    outside = tmp_path / "outside"
    (outside / "folder").mkdir(parents=True)
    (outside / "file.bin").write_bytes(LINKED_FILES["linked_from_outside.bin"])
    (outside / "folder" / "not_counted.bin").write_bytes(b"behind a linked directory")
    (root / "linked_from_outside.bin").symlink_to(outside / "file.bin")
    (root / "nested" / "linked_sibling").symlink_to("deeper/weights.bin")
    (root / "linked_folder").symlink_to(outside / "folder")
    (root / "nested" / "loop").symlink_to("..")
    (root / "dangling").symlink_to(tmp_path / "nothing here")
    return root


def _by_the_definition(files: dict[str, bytes]) -> str:
    """docs/protocol.md's content digest, from the files it must cover."""
    digest = hashlib.sha256()
    for relative in sorted(files, key=str.encode):
        data = files[relative]
        digest.update(relative.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    return "sha256:" + digest.hexdigest()


def test_the_walk_takes_the_files_in_the_byte_order_of_their_paths(adapter: Path) -> None:
    expected = sorted({**FILES, **LINKED_FILES}, key=str.encode)
    assert [relative for relative, _ in adapter_files(adapter)] == expected
    assert expected != sorted(expected, key=lambda relative: Path(relative).parts)
    assert expected != sorted(expected, key=lambda relative: relative.encode("utf-16-be"))


def test_the_digest_and_the_archive_agree_with_the_definition(
    adapter: Path, tmp_path: Path
) -> None:
    check_adapter_dir(adapter)
    archive = io.BytesIO()
    packed = pack(adapter, archive)

    assert packed == adapter_digest(adapter) == _by_the_definition({**FILES, **LINKED_FILES})
    with tarfile.open(fileobj=io.BytesIO(archive.getvalue())) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == [relative for relative, _ in adapter_files(adapter)]
    assert all(member.isfile() for member in members)  # symlinks travel as their files

    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    assert unpack(io.BytesIO(archive.getvalue()), str(unpacked)) == packed
    assert adapter_digest(unpacked) == packed
    assert not any(path.is_symlink() for path in unpacked.rglob("*"))
