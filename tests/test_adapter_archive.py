"""The streaming unpacker takes an archive of :func:`pack` in chunks of any
size, writes each member's bytes straight to its file and its digest, and
refuses, naming why, whatever is not such an archive: cut short, with a bad
extended header, sparse, or written to after it refused.

Checked against tarfile: what it unpacks is what tarfile extracts.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lorabus.adapters.archive import BadArchive, Unpacker, pack, unpack
from lorabus.adapters.digest import adapter_digest

LONG = "a-name-longer-than-a-tar-header-holds-" * 4 + ".safetensors"


def write_adapter(root: Path) -> Path:
    """An adapter whose archive needs extended headers: a long name, a name
    that is not ASCII, a nested folder, and an empty file."""
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text('{"r": 8}')
    (root / "adapter_model.safetensors").write_bytes(os.urandom(70_000))
    (root / LONG).write_bytes(os.urandom(1_000))
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "vocab-é.txt").write_text("a\nb\n")
    (root / "tokenizer" / "empty").write_bytes(b"")
    return root


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    adapter = write_adapter(tmp_path_factory.mktemp("archive") / "adapter")
    archive = io.BytesIO()
    pack(adapter, archive)
    return adapter, archive.getvalue()


def files_of(root: Path) -> dict[str, bytes]:
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def unpack_in_chunks(data: bytes, into: Path, sizes: list[int]) -> str | None:
    into.mkdir()
    unpacker = Unpacker(str(into))
    at = 0
    for size in sizes:
        unpacker.write(data[at : at + size])
        at += size
    unpacker.write(data[at:])
    return unpacker.finish()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(sizes=st.lists(st.integers(min_value=1, max_value=1500), max_size=60))
def test_any_chunking_unpacks_the_same_files_and_digest(
    packed: tuple[Path, bytes], tmp_path_factory: pytest.TempPathFactory, sizes: list[int]
) -> None:
    adapter, data = packed
    into = tmp_path_factory.mktemp("into") / "adapter"

    assert unpack_in_chunks(data, into, sizes) == adapter_digest(adapter)
    assert files_of(into) == files_of(adapter)


def test_it_unpacks_what_tarfile_extracts(packed: tuple[Path, bytes], tmp_path: Path) -> None:
    _, data = packed
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(tmp_path / "tarfile", filter="data")
    (tmp_path / "ours").mkdir()

    unpack(io.BytesIO(data), str(tmp_path / "ours"))

    assert files_of(tmp_path / "ours") == files_of(tmp_path / "tarfile")
    assert LONG in files_of(tmp_path / "ours")


@pytest.mark.parametrize("cut", [100, 512 + 30_000, 512 * 3 + 70_000])
def test_an_archive_cut_short_is_refused_at_its_end(
    packed: tuple[Path, bytes], tmp_path: Path, cut: int
) -> None:
    _, data = packed
    into = tmp_path / "into"
    into.mkdir()
    unpacker = Unpacker(str(into))
    unpacker.write(data[:cut])
    with pytest.raises(BadArchive, match="cut short"):
        unpacker.finish()


def _pax_member(records: bytes, member: bytes = b"x") -> bytes:
    """An archive of one member behind an extended header of ``records``."""
    extended = tarfile.TarInfo("././@PaxHeader")
    extended.type, extended.size = tarfile.XHDTYPE, len(records)
    data = extended.tobuf(tarfile.USTAR_FORMAT) + records + bytes(-len(records) % 512)
    file = tarfile.TarInfo("weights")
    file.size = len(member)
    return data + file.tobuf(tarfile.USTAR_FORMAT) + member + bytes(-len(member) % 512)


@pytest.mark.parametrize(
    ("records", "said"),
    [
        (b"99 path=x\n", "bad extended header"),
        (b"11 pathxyz\n", "bad extended header"),
        (b"0" * 5000 + b"9 path=x\n", "bad extended header"),
        (b"x path=y\n", "bad extended header"),
        (b"11 size=-1\n", "size"),
        ("11 size=\u00b2\n".encode(), "size"),
        (b"35 size=99999999999999999999999999\n", "size"),
        (b"14 path=a\x00bcd\n", "NUL"),
        (b"310 path=" + b"a" * 300 + b"\n", "part over 255 bytes"),
        (b"96 path=" + b"a/" * 43 + b"f\n", "over 32 levels deep"),
        (b"1212 path=" + b"abcd/" * 240 + b"f\n", "over 1024 bytes"),
        (b"28 GNU.sparse.map=0,1,2,3,4\n", "sparse"),
        (b"12 path=\xff\xfe\xfd\n", "valid adapter archive"),
    ],
)
def test_a_bad_extended_header_is_refused(tmp_path: Path, records: bytes, said: str) -> None:
    (tmp_path / "into").mkdir()
    with pytest.raises(BadArchive, match=said):
        unpack(io.BytesIO(_pax_member(records)), str(tmp_path / "into"))


def test_an_extended_header_names_and_sizes_the_member_after_it(tmp_path: Path) -> None:
    (tmp_path / "into").mkdir()
    unpack(io.BytesIO(_pax_member(b"20 path=dir/renamed\n")), str(tmp_path / "into"))
    assert files_of(tmp_path / "into") == {"dir/renamed": b"x"}


def test_after_a_refusal_every_write_is_refused(tmp_path: Path) -> None:
    """The fetch stops at the first bad chunk; a late write changes nothing."""
    (tmp_path / "into").mkdir()
    unpacker = Unpacker(str(tmp_path / "into"))
    with pytest.raises(BadArchive, match="valid adapter archive"):
        unpacker.write(b"\xff" * 1024)
    with pytest.raises(BadArchive, match="stopped"):
        unpacker.write(bytes(512))
    assert list((tmp_path / "into").iterdir()) == []


def test_a_directory_with_data_is_refused(tmp_path: Path) -> None:
    folder = tarfile.TarInfo("folder")
    folder.type, folder.size = tarfile.DIRTYPE, 3
    (tmp_path / "into").mkdir()
    with pytest.raises(BadArchive, match="directory with data"):
        unpack(io.BytesIO(folder.tobuf(tarfile.USTAR_FORMAT) + b"abc"), str(tmp_path / "into"))


@pytest.mark.parametrize(
    ("size_field", "said"),
    [(b"\xff" * 11 + b"\xfb", "size of -5"), (b"\x80" + b"\xff" * 11, "size of 3094850")],
)
def test_a_negative_or_huge_size_is_refused(tmp_path: Path, size_field: bytes, said: str) -> None:
    """tarfile parses GNU's base-256 numbers, negative and huge ones included."""
    member = tarfile.TarInfo("weights")
    member.size = 5
    block = bytearray(member.tobuf(tarfile.GNU_FORMAT))
    block[124:136] = size_field
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block[:512])
    (tmp_path / "into").mkdir()
    with pytest.raises(BadArchive, match=said):
        unpack(io.BytesIO(bytes(block) + b"x" * 512), str(tmp_path / "into"))


def _headers(*members: tarfile.TarInfo) -> bytes:
    """Header blocks only: each member's size is 0 unless it is an extended header."""
    return b"".join(member.tobuf(tarfile.USTAR_FORMAT) for member in members)


def _info(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    return info


@pytest.mark.parametrize(
    "members",
    [
        [_info("a"), _info("a/b")],
        [_info("a", tarfile.DIRTYPE), _info("a")],
        [_info("a/b"), _info("a", tarfile.DIRTYPE), _info("a/b")],
    ],
    ids=["a file where a folder is", "a file over a folder", "the same file twice"],
)
def test_members_whose_names_clash_are_refused(
    tmp_path: Path, members: list[tarfile.TarInfo]
) -> None:
    (tmp_path / "into").mkdir()
    with pytest.raises(BadArchive, match="comes twice"):
        unpack(io.BytesIO(_headers(*members)), str(tmp_path / "into"))


def test_two_extended_headers_in_a_row_are_refused(tmp_path: Path) -> None:
    records = b"11 path=ab\n"
    extended = _info("././@PaxHeader", tarfile.XHDTYPE, len(records))
    one = extended.tobuf(tarfile.USTAR_FORMAT) + records + bytes(512 - len(records))
    (tmp_path / "into").mkdir()
    with pytest.raises(BadArchive, match="bad extended header"):
        unpack(io.BytesIO(one + one + _headers(_info("x"))), str(tmp_path / "into"))


def test_an_extended_header_larger_than_any_adapter_needs_is_refused(tmp_path: Path) -> None:
    """Its records are gathered in memory: their size is bounded before they come."""
    extended = _info("././@PaxHeader", tarfile.XHDTYPE, (64 << 10) + 1)
    (tmp_path / "into").mkdir()
    unpacker = Unpacker(str(tmp_path / "into"))
    with pytest.raises(BadArchive, match="bad extended header"):
        unpacker.write(_headers(extended))


@pytest.mark.parametrize(
    "cut", [512, 1024], ids=["inside the extended header", "before its member"]
)
def test_an_archive_cut_around_an_extended_header_is_refused(tmp_path: Path, cut: int) -> None:
    (tmp_path / "into").mkdir()
    unpacker = Unpacker(str(tmp_path / "into"))
    unpacker.write(_pax_member(b"11 path=ab\n")[:cut])
    with pytest.raises(BadArchive, match="cut short"):
        unpacker.finish()
