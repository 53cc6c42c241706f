"""Adapters travel over the bus: pushed once into the fleet's object store under
their content digest, fetched back byte for byte with direct gets only, and
refused, by name, whenever what the store holds is not what was pushed.

Against a real nats-server: the object store's layout, the direct-get batches
and the server's answers for what is missing are what the code relies on.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import tarfile
import threading
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import BinaryIO, cast

import pytest
from adapter_dirs import write_adapter
from nats.aio.client import Client as NatsClient
from store_helpers import store_connection

from lorabus.adapters import archive as adapter_archive
from lorabus.adapters import fetch as adapter_fetch
from lorabus.adapters import store as adapter_objects
from lorabus.adapters.archive import pack, unpack
from lorabus.adapters.bus_paths import bus_path, digest_of
from lorabus.adapters.digest import adapter_digest
from lorabus.adapters.fetch import fetch_object
from lorabus.adapters.store import (
    delete_chunks,
    delete_object,
    object_size,
    push_adapter,
    store_config,
    store_contents,
)
from lorabus.bus.connect import close, connect
from lorabus.errors import BadRequest, BusError, FetchFailed, NatsServerMissing
from lorabus.schemas import Subjects
from lorabus.testbed.natsserver import NatsServer

MB = 1000 * 1000


@pytest.fixture
def subjects(fleet_name: str) -> Subjects:
    return Subjects(fleet=fleet_name)


@pytest.fixture
async def nc(nats_url: str, subjects: Subjects) -> AsyncIterator[NatsClient]:
    """A connection to a fleet whose adapter store exists, as provision makes it."""
    async with store_connection(nats_url, subjects) as connection:
        yield connection


def stream_of(subjects: Subjects) -> str:
    return f"OBJ_{subjects.adapter_store()}"


def meta_subject(subjects: Subjects, digest: str) -> str:
    name = base64.urlsafe_b64encode(digest.encode()).decode()
    return f"$O.{subjects.adapter_store()}.M.{name}"


async def stored_messages(nc: NatsClient, subjects: Subjects) -> int:
    return int((await nc.jetstream().stream_info(stream_of(subjects))).state.messages)


async def fetch_and_unpack(
    nc: NatsClient, subjects: Subjects, digest: str, tmp_path: Path
) -> tuple[int, Path]:
    archive, unpacked = tmp_path / "fetched.tar", tmp_path / "unpacked"
    unpacked.mkdir()
    with archive.open("wb") as into:
        size = await fetch_object(nc, subjects, digest, into, timeout_s=30, max_bytes=1 << 30)
    unpack(str(archive), str(unpacked))
    return size, unpacked


async def test_a_pushed_adapter_comes_back_byte_for_byte(
    nc: NatsClient, subjects: Subjects, tmp_path: Path
) -> None:
    adapter = write_adapter(tmp_path / "adapter")
    digest, uploaded = await push_adapter(nc, subjects, str(adapter), timeout_s=30)
    assert (digest, uploaded) == (adapter_digest(adapter), True)

    size, unpacked = await fetch_and_unpack(nc, subjects, digest, tmp_path)

    assert await object_size(nc, subjects, digest) == size
    assert adapter_digest(unpacked) == digest
    assert (unpacked / "sub" / "notes.txt").read_text() == "step"


async def test_a_large_adapter_round_trips_through_little_memory(
    nc: NatsClient, subjects: Subjects, tmp_path: Path
) -> None:
    """An adapter can be many GB: the fetch holds a batch of chunks, never the object."""
    adapter = write_adapter(tmp_path / "adapter", os.urandom(64 * MB))
    digest, _ = await push_adapter(nc, subjects, str(adapter), timeout_s=60)

    tracemalloc.start()
    try:
        size, unpacked = await fetch_and_unpack(nc, subjects, digest, tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert size > 64 * MB
    # A 4 MiB batch, and the copies of its messages on their way to the file.
    assert peak < 16 * MB, f"the fetch held {peak / MB:.1f} MB at its peak"
    assert adapter_digest(unpacked) == digest


async def test_the_same_content_is_uploaded_once(
    nc: NatsClient, subjects: Subjects, tmp_path: Path
) -> None:
    """Same files, other directory and times: same bytes, so nothing is sent again."""
    first = write_adapter(tmp_path / "first")
    digest, uploaded = await push_adapter(nc, subjects, str(first), timeout_s=30)
    assert uploaded
    stored = await stored_messages(nc, subjects)

    again = write_adapter(tmp_path / "again")
    os.utime(again / "adapter_model.safetensors", (1, 1))
    assert await push_adapter(nc, subjects, str(again), timeout_s=30) == (digest, False)
    assert await stored_messages(nc, subjects) == stored


async def test_a_push_out_of_time_stores_nothing_under_its_digest(
    nc: NatsClient, subjects: Subjects, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push cut short by its deadline (here its second chunk never gets an
    answer) stores no meta, so nothing is found under its digest; its chunks
    are left for the leader's sweep, which only the coordinator may make."""
    adapter = write_adapter(tmp_path / "adapter", os.urandom(2 * MB))  # four chunks
    real_publish = adapter_objects._publish
    published: list[str] = []

    async def stalls_after_the_first(js: object, s: Subjects, subject: str, data: bytes) -> None:
        published.append(subject)
        if len(published) > 1:
            await asyncio.Event().wait()  # no answer, ever
        await real_publish(js, s, subject, data)  # type: ignore[arg-type]

    monkeypatch.setattr(adapter_objects, "_publish", stalls_after_the_first)
    # Long enough to pack 2 MB on any machine: the stall, not the speed, ends it.
    with pytest.raises(BusError, match=r"not done within its deadline of 3s"):
        await push_adapter(nc, subjects, str(adapter), timeout_s=3)
    digest = adapter_digest(adapter)

    assert await object_size(nc, subjects, digest) is None
    contents = await store_contents(nc, subjects)
    assert contents.objects == {} and len(contents.stray_chunks) == 1
    await delete_chunks(nc, subjects, next(iter(contents.stray_chunks)))
    assert await stored_messages(nc, subjects) == 0


async def test_a_directory_that_changes_mid_push_stores_nothing(
    nc: NatsClient, subjects: Subjects, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer still writing its weights while they are pushed: the push
    fails, saying so, and no object names a digest its bytes do not have."""
    adapter = write_adapter(tmp_path / "adapter", os.urandom(MB))
    weights = adapter / "adapter_model.safetensors"
    real_read = adapter_archive._Hashing.read

    def rewritten_midway(self: object, size: int = -1, /) -> bytes:
        data = real_read(self, size)  # type: ignore[arg-type]
        with weights.open("r+b") as file:  # the same size, other bytes
            file.write(os.urandom(16))
        return data

    monkeypatch.setattr(adapter_archive._Hashing, "read", rewritten_midway)
    with pytest.raises(BadRequest, match=r"changed while it was packed.*nothing was stored"):
        await push_adapter(nc, subjects, str(adapter), timeout_s=30)

    assert await stored_messages(nc, subjects) == 0


def test_the_digest_of_a_pack_is_that_of_its_bytes(tmp_path: Path) -> None:
    """One read: the digest pack returns is what unpacking its archive finds,
    and what the directory's digest is."""
    adapter = write_adapter(tmp_path / "adapter", os.urandom(300_000))
    archive = io.BytesIO()
    digest = pack(adapter, archive)
    (tmp_path / "out").mkdir()
    assert digest == adapter_digest(adapter)
    assert unpack(io.BytesIO(archive.getvalue()), str(tmp_path / "out")) == digest


def test_packing_depends_on_the_files_only(tmp_path: Path) -> None:
    first, second = write_adapter(tmp_path / "a"), write_adapter(tmp_path / "b")
    os.utime(second / "adapter_config.json", (1, 1))
    os.chmod(second / "adapter_config.json", 0o600)
    packed = [io.BytesIO(), io.BytesIO()]
    pack(first, packed[0])
    pack(second, packed[1])
    assert packed[0].getvalue() == packed[1].getvalue()


@pytest.mark.parametrize(
    "problem", ["no config", "no weights", "not a directory", "missing", "too deep"]
)
async def test_what_is_not_an_adapter_is_refused_before_any_upload(
    nc: NatsClient, subjects: Subjects, tmp_path: Path, problem: str
) -> None:
    adapter = write_adapter(tmp_path / "adapter")
    if problem == "no config":
        (adapter / "adapter_config.json").unlink()
    elif problem == "no weights":
        (adapter / "adapter_model.safetensors").unlink()
    elif problem == "not a directory":
        adapter = adapter / "adapter_config.json"
    elif problem == "too deep":  # no agent would unpack it
        deep = adapter.joinpath(*["d"] * 40)
        deep.mkdir(parents=True)
        (deep / "notes.txt").write_text("x")
    else:
        adapter = tmp_path / "nowhere"

    with pytest.raises(BadRequest, match="cannot push"):
        await push_adapter(nc, subjects, str(adapter), timeout_s=30)
    assert await stored_messages(nc, subjects) == 0


async def test_a_fleet_without_a_store_is_told_to_provision(
    nats_url: str, fleet_name: str, tmp_path: Path
) -> None:
    nc = await connect(nats_url, name="test-no-store")
    try:
        with pytest.raises(BusError, match="lorabus provision"):
            await push_adapter(nc, Subjects(fleet=fleet_name), str(write_adapter(tmp_path / "a")))
    finally:
        await close(nc)


async def test_a_store_nobody_answers_for_a_moment_is_asked_again_not_called_missing(
    nc: NatsClient, subjects: Subjects, tmp_path: Path
) -> None:
    """In a cluster, only current replicas answer direct gets: a node that has
    just restarted can leave a moment with none, which must not pass for a
    store that was never provisioned. Here direct gets are switched off, and
    back on while the look and the fetch are waiting."""
    digest, _ = await push_adapter(nc, subjects, str(write_adapter(tmp_path / "a")))
    js = nc.jetstream()
    silent = store_config(subjects)
    silent.allow_direct = False
    await js.update_stream(silent)
    looking = asyncio.ensure_future(object_size(nc, subjects, digest, timeout_s=10))
    fetching = asyncio.ensure_future(
        fetch_object(nc, subjects, digest, io.BytesIO(), timeout_s=10, max_bytes=MB)
    )
    await asyncio.sleep(0.3)
    assert not looking.done() and not fetching.done()
    await js.update_stream(store_config(subjects))

    size = await looking
    assert size is not None and size > 0
    assert await fetching == size


class _PausingSink(io.BytesIO):
    """Holds its first write until told to go on: the fetch asks for its next
    batch only after it, so the test can change the store in between."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._loop = loop
        self.first_write = asyncio.Event()
        self.go_on = threading.Event()

    def write(self, data: object, /) -> int:
        if not self.first_write.is_set():
            self._loop.call_soon_threadsafe(self.first_write.set)
            assert self.go_on.wait(timeout=10)
        return super().write(data)  # type: ignore[call-overload]


@pytest.mark.parametrize("silence", ["for a moment", "for good"])
async def test_a_batch_nobody_answers_is_asked_again_then_said_so(
    nc: NatsClient,
    subjects: Subjects,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    silence: str,
) -> None:
    """The same moment without replicas, in the middle of a fetch (its meta
    read, its first batch written): the next batch is asked for again. When
    no replica ever answers, the fetch says so, not "run lorabus provision":
    the store was read a moment ago."""
    if silence == "for good":
        monkeypatch.setattr(adapter_fetch, "_BATCH_RETRY_GAP_S", 0.01)
    weights = os.urandom(6 * MB)  # more than one batch
    digest, _ = await push_adapter(nc, subjects, str(write_adapter(tmp_path / "a", weights)))
    js = nc.jetstream()
    sink = _PausingSink(asyncio.get_running_loop())
    fetching = asyncio.ensure_future(
        fetch_object(nc, subjects, digest, sink, timeout_s=20, max_bytes=20 * MB)
    )
    try:
        await asyncio.wait_for(sink.first_write.wait(), timeout=10)
        silent = store_config(subjects)
        silent.allow_direct = False
        await js.update_stream(silent)
        sink.go_on.set()
        if silence == "for good":
            with pytest.raises(FetchFailed, match=r"no replica of adapter store .* answered"):
                await fetching
            return
        await asyncio.sleep(0.3)
        assert not fetching.done()
        await js.update_stream(store_config(subjects))

        size = await fetching
    finally:
        sink.go_on.set()
        fetching.cancel()
    assert size == len(sink.getvalue()) > 6 * MB
    (tmp_path / "out").mkdir()
    assert unpack(io.BytesIO(sink.getvalue()), str(tmp_path / "out")) == digest


async def test_a_store_that_never_answers_is_told_to_provision(
    nats_url: str, fleet_name: str
) -> None:
    nc = await connect(nats_url, name="test-no-store")
    try:
        with pytest.raises(BusError, match="lorabus provision"):
            await object_size(nc, Subjects(fleet=fleet_name), "sha256:" + "0" * 64)
        with pytest.raises(FetchFailed, match="lorabus provision"):
            await fetch_object(
                nc,
                Subjects(fleet=fleet_name),
                "sha256:" + "0" * 64,
                io.BytesIO(),
                timeout_s=10,
                max_bytes=MB,
            )
    finally:
        await close(nc)


async def test_an_unknown_or_deleted_adapter_has_no_size_and_cannot_be_fetched(
    nc: NatsClient, subjects: Subjects, tmp_path: Path
) -> None:
    unknown = "sha256:" + "0" * 64
    assert await object_size(nc, subjects, unknown) is None
    with pytest.raises(FetchFailed, match=f"{unknown} is not in the fleet's store"):
        await fetch_object(nc, subjects, unknown, io.BytesIO(), timeout_s=10, max_bytes=MB)

    digest, _ = await push_adapter(nc, subjects, str(write_adapter(tmp_path / "a")))
    assert await delete_object(nc, subjects, digest) is True
    assert await delete_object(nc, subjects, digest) is False
    assert await object_size(nc, subjects, digest) is None
    with pytest.raises(FetchFailed, match=f"{digest} is not in the fleet's store"):
        await fetch_object(nc, subjects, digest, io.BytesIO(), timeout_s=10, max_bytes=MB)


async def test_an_object_over_the_limit_is_refused_before_it_is_read(
    nc: NatsClient, subjects: Subjects, tmp_path: Path
) -> None:
    digest, _ = await push_adapter(nc, subjects, str(write_adapter(tmp_path / "a")))
    size = await object_size(nc, subjects, digest)
    assert size is not None
    into = io.BytesIO()
    with pytest.raises(FetchFailed, match=f"{digest} is {size} bytes, over the limit"):
        await fetch_object(nc, subjects, digest, into, timeout_s=10, max_bytes=size - 1)
    assert into.tell() == 0


@pytest.mark.parametrize(
    ("tampering", "said"),
    [
        ("chunks gone", "short"),
        ("meta claims more bytes", "short"),
        ("meta claims more chunks", "short"),
        ("meta names a wildcard", "not one of a pushed adapter"),
    ],
)
async def test_a_tampered_object_is_refused(
    nc: NatsClient, subjects: Subjects, tmp_path: Path, tampering: str, said: str
) -> None:
    adapter = write_adapter(tmp_path / "a", os.urandom(1_200_000))  # three chunks
    digest, _ = await push_adapter(nc, subjects, str(adapter))
    js = nc.jetstream()
    meta = json.loads(
        (await js.get_last_msg(stream_of(subjects), meta_subject(subjects, digest))).data
    )
    chunks = f"$O.{subjects.adapter_store()}.C.{digest.removeprefix('sha256:')}.{meta['nuid']}"
    if tampering.startswith("meta"):
        if "bytes" in tampering:
            meta["size"] += 1
        elif "chunks" in tampering:
            meta["chunks"] += 1
        else:
            meta["nuid"] = ">"
        # Written once: only a purge first lets another meta in.
        await js.purge_stream(stream_of(subjects), subject=meta_subject(subjects, digest))
        await js.publish(meta_subject(subjects, digest), json.dumps(meta).encode())
    else:
        await js.purge_stream(stream_of(subjects), subject=f"{chunks}.>")

    with pytest.raises(FetchFailed, match=f"{digest}.*{said}"):
        await fetch_object(nc, subjects, digest, io.BytesIO(), timeout_s=10, max_bytes=1 << 30)


class _StopsServerOnFirstWrite:
    def __init__(self, server: NatsServer) -> None:
        self.server = server

    def write(self, data: bytes) -> int:
        self.server.stop()
        return len(data)


async def test_a_server_gone_mid_transfer_fails_the_fetch(
    subjects: Subjects, tmp_path: Path
) -> None:
    server = NatsServer()
    try:
        await server.start()
    except NatsServerMissing as exc:
        pytest.skip(str(exc))
    try:
        nc = await connect(server.url, name="test-server-gone")
        await nc.jetstream().add_stream(store_config(subjects))
        adapter = write_adapter(tmp_path / "a", os.urandom(8 * MB))
        digest, _ = await push_adapter(nc, subjects, str(adapter))
        into = cast(BinaryIO, _StopsServerOnFirstWrite(server))
        with pytest.raises(FetchFailed, match=digest):
            await fetch_object(nc, subjects, digest, into, timeout_s=3, max_bytes=1 << 30)
        await close(nc)
    finally:
        server.stop()


def _tar_with(path: Path, member: tarfile.TarInfo) -> str:
    with tarfile.open(path, "w") as tar:
        tar.addfile(member, io.BytesIO(b"x" * member.size))
    return str(path)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("../x", tarfile.REGTYPE),
        ("a/../../x", tarfile.REGTYPE),
        ("/tmp/x", tarfile.REGTYPE),
        ("link", tarfile.SYMTYPE),
        ("hard", tarfile.LNKTYPE),
        ("device", tarfile.CHRTYPE),
        ("fifo", tarfile.FIFOTYPE),
    ],
)
def test_unpack_refuses_what_could_escape_or_is_no_file(
    tmp_path: Path, name: str, kind: bytes
) -> None:
    member = tarfile.TarInfo(name)
    member.type = kind
    member.size = 1 if kind == tarfile.REGTYPE else 0
    member.linkname = "/etc/passwd" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(ValueError, match="archive member"):
        unpack(_tar_with(tmp_path / "bad.tar", member), str(into))
    assert list(into.iterdir()) == []
    assert not (tmp_path / "x").exists()


def test_unpack_refuses_too_many_members_and_a_full_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = write_adapter(tmp_path / "a")
    archive = tmp_path / "a.tar"
    with archive.open("wb") as into:
        pack(adapter, into)
    monkeypatch.setattr(adapter_archive, "MAX_FILES", 2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="more than 2 members"):
        unpack(str(archive), str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="is not empty"):
        unpack(str(archive), str(tmp_path / "a"))


def test_a_bus_path_names_a_digest_and_nothing_else() -> None:
    digest = "sha256:" + "ab" * 32
    assert digest_of(bus_path(digest)) == digest
    assert digest_of("/srv/adapters/step-1") is None
    with pytest.raises(ValueError, match="not a valid bus path"):
        digest_of("bus:sha256:XYZ")
    with pytest.raises(ValueError, match="not a valid bus path"):
        digest_of("bus:" + digest + "/../x")
    with pytest.raises(ValueError, match="not an adapter digest"):
        bus_path("md5:" + "ab" * 16)


def test_unpack_keeps_no_mode_owner_or_time_of_the_archive_and_refuses_a_twin(
    tmp_path: Path,
) -> None:
    """A setuid, world-writable file owned by someone else arrives as a plain
    0644 file of ours; a second member of the same name is no adapter."""
    member = tarfile.TarInfo("weights.bin")
    member.size, member.mode, member.uid, member.mtime = 4, 0o4777, 4242, 1
    into = tmp_path / "into"
    into.mkdir()
    unpack(_tar_with(tmp_path / "odd.tar", member), str(into))
    written = (into / "weights.bin").stat()

    twin = tmp_path / "twin.tar"
    with tarfile.open(twin, "w") as tar:
        for _ in range(2):
            tar.addfile(tarfile.TarInfo("a"), io.BytesIO(b""))
    (tmp_path / "twin").mkdir()

    assert (written.st_mode & 0o7777, written.st_uid) == (0o644 & ~_umask(), os.getuid())
    assert written.st_mtime > 1
    with pytest.raises(ValueError, match="comes twice"):
        unpack(str(twin), str(tmp_path / "twin"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_unpack_takes_the_adapter_digest_as_it_writes_or_leaves_it_to_the_files(
    tmp_path: Path,
) -> None:
    """An archive of pack's order gives the digest of what was written; one in
    another order gives None, for the caller to hash the files."""
    adapter = write_adapter(tmp_path / "a", os.urandom(1000))
    archive = tmp_path / "a.tar"
    with archive.open("wb") as into:
        pack(adapter, into)
    reordered = tmp_path / "b.tar"
    with tarfile.open(archive) as source, tarfile.open(reordered, "w") as target:
        for member in reversed(source.getmembers()):
            target.addfile(member, source.extractfile(member))
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()

    assert unpack(str(archive), str(tmp_path / "x")) == adapter_digest(adapter)
    assert unpack(str(reordered), str(tmp_path / "y")) is None
    assert adapter_digest(tmp_path / "y") == adapter_digest(adapter)
