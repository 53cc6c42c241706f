"""A node's adapter cache hands an engine exactly the adapter a digest names:
fetched once however many agents of the node ask at the same moment, checked
on every use, and never left half-written or wrong on disk.

The fetch is a stand-in that writes the archive the real packing code makes
(tests/test_adapter_objects.py fetches from a real store); everything on disk
is real, and so are the locks between OS processes.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cache_doubles import Store

from lorabus.adapters import archive as adapter_archive
from lorabus.adapters.digest import adapter_digest
from lorabus.adapters.fetch import ChunkSink
from lorabus.agents import adapter_cache
from lorabus.agents.adapter_cache import AdapterCache
from lorabus.errors import DigestMismatch, FetchFailed


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def leftovers(cache_dir: Path) -> list[str]:
    """What the cache holds besides its lock and holder files."""
    found = [
        p.name for p in cache_dir.iterdir() if p.name not in (".locks", ".partial", ".holders")
    ]
    return found + [p.name for p in (cache_dir / ".partial").iterdir()]


async def test_an_adapter_is_fetched_once_then_served_from_the_cache(
    store: Store, cache_dir: Path
) -> None:
    digest = store.add(b"weights")
    cache = AdapterCache(str(cache_dir))
    first = await cache.get(digest, store.fetch, timeout_s=10)
    second = await cache.get(digest, store.fetch, timeout_s=10)

    assert first == second == str(cache_dir / digest.removeprefix("sha256:"))
    assert adapter_digest(first) == digest
    assert (Path(first) / "sub" / "notes.txt").read_text() == "step"
    assert store.fetches == [digest]


async def test_two_caches_asking_at_once_fetch_once(
    store: Store, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the first fetches, the second waits on its lock (seen refused), then
    finds the entry; were it not held off, it would fetch too."""
    digest = store.add(b"weights")
    store.gate = asyncio.Event()
    second_held = asyncio.Event()
    try_acquire = adapter_cache._Lock.try_acquire

    def spied(lock: adapter_cache._Lock) -> bool:
        got = try_acquire(lock)
        if not got:
            second_held.set()
        return got

    async def second_fetch(digest: str, into: ChunkSink) -> int:
        second_held.set()  # not held: the fetch count says so below
        return await store.fetch(digest, into)

    monkeypatch.setattr(adapter_cache._Lock, "try_acquire", spied)
    async with asyncio.timeout(10), asyncio.TaskGroup() as tasks:
        first = tasks.create_task(
            AdapterCache(str(cache_dir)).get(digest, store.fetch, timeout_s=10)
        )
        await store.fetching.wait()
        second = tasks.create_task(
            AdapterCache(str(cache_dir)).get(digest, second_fetch, timeout_s=10)
        )
        await second_held.wait()
        store.gate.set()

    assert store.fetches == [digest]
    assert first.result() == second.result()


_PROCESS = """
import asyncio, io, sys
from lorabus.adapters.archive import pack
from lorabus.agents import adapter_cache

cache_dir, adapter, digest = sys.argv[1:]
try_acquire = adapter_cache._Lock.try_acquire
waited = []

def spied(lock):
    got = try_acquire(lock)
    if not got and not waited:
        waited.append(print("waiting", flush=True))
    return got

adapter_cache._Lock.try_acquire = spied

async def fetch(digest, into):
    print("fetching", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # the test's go
    packed = io.BytesIO()
    pack(adapter, packed)
    await asyncio.to_thread(into.write, packed.getvalue())
    return len(packed.getvalue())

print(asyncio.run(adapter_cache.AdapterCache(cache_dir).get(digest, fetch, timeout_s=30)))
"""


async def test_two_processes_on_one_node_fetch_once(store: Store, cache_dir: Path) -> None:
    """Each process says on stdout when it fetches and when it found the lock held."""
    digest = store.add(b"weights")
    argv = [sys.executable, "-c", _PROCESS, str(cache_dir), str(store.adapters[digest]), digest]
    pipe = asyncio.subprocess.PIPE
    started: list[asyncio.subprocess.Process] = []
    try:
        async with asyncio.timeout(60):
            started.append(await asyncio.create_subprocess_exec(*argv, stdin=pipe, stdout=pipe))
            first = started[0]
            assert first.stdout is not None
            assert await first.stdout.readline() == b"fetching\n"
            started.append(await asyncio.create_subprocess_exec(*argv, stdin=pipe, stdout=pipe))
            second = started[1]
            assert second.stdout is not None
            assert await second.stdout.readline() == b"waiting\n"
            outputs = [(await first.communicate(b"go\n"))[0], (await second.communicate(b""))[0]]
    finally:
        for process in started:
            if process.returncode is None:
                process.kill()
                await process.wait()

    assert [first.returncode, second.returncode] == [0, 0]
    entry = str(cache_dir / digest.removeprefix("sha256:"))
    assert [out.decode().split() for out in outputs] == [[entry], [entry]]


def _change(entry: Path, how: str) -> None:
    if how == "a file changed":
        with (entry / "adapter_model.safetensors").open("ab") as weights:
            weights.write(b"!")
    elif how == "a file missing":
        (entry / "sub" / "notes.txt").unlink()
    elif how == "a file added":
        (entry / "extra.bin").write_bytes(b"?")
    else:
        shutil.rmtree(entry)
        entry.write_text("not a directory")


@pytest.mark.parametrize("how", ["a file changed", "a file missing", "a file added", "a file"])
async def test_a_damaged_entry_is_fetched_again_never_served(
    store: Store, cache_dir: Path, how: str
) -> None:
    digest = store.add(b"weights")
    cache = AdapterCache(str(cache_dir))
    entry = Path(await cache.get(digest, store.fetch, timeout_s=10))
    _change(entry, how)

    assert await cache.get(digest, store.fetch, timeout_s=10) == str(entry)
    assert adapter_digest(entry) == digest
    assert store.fetches == [digest, digest]
    assert leftovers(cache_dir) == [entry.name]


async def test_a_tenants_object_is_served_from_the_cache_only_once_its_store_gave_it(
    store: Store, cache_dir: Path
) -> None:
    """Tenant a's adapter is cached; tenant b names the same digest in its own
    store, where it wrote a meta record but has not the bytes: b is refused,
    the cached entry stays, and only once b's store gives the bytes is b
    served from the cache (checked, not fetched into place again)."""
    digest, other = store.add(b"a's weights"), store.add(b"b's junk")
    cache = AdapterCache(str(cache_dir))
    entry = await cache.get(digest, store.fetch, timeout_s=10, source=f"a/{digest}")

    async def bs_store(wanted: str, into: ChunkSink) -> int:
        return await store.fetch(other, into)  # b never had a's bytes

    with pytest.raises(DigestMismatch):
        await cache.get(digest, bs_store, timeout_s=10, source=f"b/{digest}")
    assert adapter_digest(entry) == digest
    assert leftovers(cache_dir) == [Path(entry).name]  # nothing of b's fetch stays
    # a again, and the fleet's own store: from the cache, no fetch.
    fetched = len(store.fetches)
    assert await cache.get(digest, store.fetch, timeout_s=10, source=f"a/{digest}") == entry
    assert await cache.get(digest, store.fetch, timeout_s=10) == entry
    assert len(store.fetches) == fetched
    # b pushes the bytes for real: checked once, then from the cache.
    assert await cache.get(digest, store.fetch, timeout_s=10, source=f"b/{digest}") == entry
    assert await cache.get(digest, store.fetch, timeout_s=10, source=f"b/{digest}") == entry
    assert len(store.fetches) == fetched + 1


async def test_other_content_is_a_digest_mismatch_and_leaves_nothing(
    store: Store, cache_dir: Path
) -> None:
    wanted, other = store.add(b"wanted"), store.add(b"other")

    async def lying(digest: str, into: ChunkSink) -> int:
        return await store.fetch(other, into)

    with pytest.raises(DigestMismatch, match=f"{wanted}.*{other}"):
        await AdapterCache(str(cache_dir)).get(wanted, lying, timeout_s=10)
    assert leftovers(cache_dir) == []


async def _fails(digest: str, into: ChunkSink) -> int:
    into.write(b"half an archive")
    raise RuntimeError("the bus went away")


async def _not_a_tar(digest: str, into: ChunkSink) -> int:
    return into.write(b"\0garbage" * 1000)


@pytest.mark.parametrize(
    ("fetch", "said"),
    [(_fails, "the bus went away"), (_not_a_tar, "is no adapter")],
)
async def test_a_failed_fetch_leaves_nothing_and_the_next_get_succeeds(
    store: Store,
    cache_dir: Path,
    fetch: Callable[[str, ChunkSink], Awaitable[int]],
    said: str,
) -> None:
    digest = store.add(b"weights")
    cache = AdapterCache(str(cache_dir))
    with pytest.raises(FetchFailed, match=f"{digest}.*{said}"):
        await cache.get(digest, fetch, timeout_s=10)
    assert leftovers(cache_dir) == []

    assert adapter_digest(await cache.get(digest, store.fetch, timeout_s=10)) == digest


async def test_many_nodes_fetching_in_one_process_on_a_small_pool_all_finish(
    store: Store, tmp_path: Path
) -> None:
    """A host process with agents of many nodes fetches for each at once, and
    each fetch unpacks in the loop's thread pool as it writes: with more
    fetches than pool threads, each still ends (none waits on another)."""
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))
    digest = store.add(os.urandom(1 << 20))
    caches = [AdapterCache(str(tmp_path / f"node{n}")) for n in range(6)]

    async with asyncio.timeout(30):
        entries = await asyncio.gather(
            *(cache.get(digest, store.fetch, timeout_s=20) for cache in caches)
        )

    assert [adapter_digest(entry) for entry in entries] == [digest] * len(caches)


async def test_a_bad_archive_stops_the_fetch_at_its_first_chunk(
    store: Store, cache_dir: Path
) -> None:
    """The unpacking refuses the first chunk that cannot be the archive, and so
    the fetch stops there instead of reading the rest of the object."""
    digest = store.add(b"weights")
    written: list[int] = []

    async def garbage(digest: str, into: ChunkSink) -> int:
        for _ in range(64):
            written.append(await asyncio.to_thread(into.write, b"\xff" * (16 << 10)))
        return sum(written)

    with pytest.raises(FetchFailed, match=f"{digest}.*is no adapter"):
        await AdapterCache(str(cache_dir)).get(digest, garbage, timeout_s=10)
    assert written == []
    assert leftovers(cache_dir) == []


@pytest.mark.parametrize("stop", ["cancelled", "out of time"])
async def test_a_fetch_cut_short_leaves_nothing_and_the_next_get_succeeds(
    store: Store, cache_dir: Path, stop: str
) -> None:
    digest = store.add(b"weights")
    cache = AdapterCache(str(cache_dir))
    store.gate = asyncio.Event()  # never set: the fetch hangs
    if stop == "cancelled":
        getting = asyncio.create_task(cache.get(digest, store.fetch, timeout_s=30))
        async with asyncio.timeout(10):
            await store.fetching.wait()
        getting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await getting
    else:
        with pytest.raises(FetchFailed, match=f"{digest} was not in this node's cache within"):
            await cache.get(digest, store.fetch, timeout_s=0.2)
    assert leftovers(cache_dir) == []

    store.gate.set()
    assert adapter_digest(await cache.get(digest, store.fetch, timeout_s=10)) == digest


async def test_a_fetch_cancelled_twice_mid_write_leaves_nothing(
    store: Store, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write runs on in its thread when the fetch is cancelled; the clean-up
    waits for it, and a second cancel while it waits must not leave the
    half-unpacked folder (or its open file) behind."""
    digest = store.add(b"weights" * 1000)
    loop = asyncio.get_running_loop()
    writing, release = asyncio.Event(), threading.Event()
    write_all = adapter_archive._write_all

    def slow_write_all(descriptor: int | None, data: memoryview) -> None:
        loop.call_soon_threadsafe(writing.set)
        assert release.wait(timeout=10)
        write_all(descriptor, data)

    monkeypatch.setattr(adapter_archive, "_write_all", slow_write_all)
    getting = asyncio.create_task(
        AdapterCache(str(cache_dir)).get(digest, store.fetch, timeout_s=30)
    )
    try:
        async with asyncio.timeout(10):
            await writing.wait()
        getting.cancel()
        await asyncio.sleep(0.1)  # the clean-up now waits for the write
        assert not getting.done()
        getting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await getting
    finally:
        release.set()
    async with asyncio.timeout(10):
        while leftovers(cache_dir):  # noqa: ASYNC110 (a thread of the executor removes it)
            await asyncio.sleep(0.02)


async def test_prune_keeps_the_most_recent_the_protected_and_the_busy(
    store: Store, cache_dir: Path
) -> None:
    cache = AdapterCache(str(cache_dir), keep=2)
    digests = [store.add(bytes([n])) for n in range(5)]
    for used, digest in enumerate(digests):
        entry = await cache.get(digest, store.fetch, timeout_s=10)
        os.utime(entry, (1000 + used, 1000 + used))
    oldest, protected, busy, recent = digests[0], digests[1], digests[2], digests[3:]
    lock = os.open(cache_dir / ".locks" / f"{busy[7:]}.lock", os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as another process fetching or checking it
    stale = cache_dir / ".partial" / f"{oldest[7:]}.dead.tar"
    stale.write_bytes(b"left by a process that died")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    fresh = cache_dir / ".partial" / f"{busy[7:]}.live.tar"
    fresh.touch()
    try:
        assert cache.prune(protect=[protected]) == [oldest]
    finally:
        os.close(lock)

    kept = {f"sha256:{name}" for name in os.listdir(cache_dir) if not name.startswith(".")}
    assert kept == {protected, busy, *recent}
    assert os.listdir(cache_dir / ".partial") == [fresh.name]
    assert cache.prune(protect=[protected]) == [busy]  # no longer busy
    assert await cache.get(oldest, store.fetch, timeout_s=10)
    assert store.fetches.count(oldest) == 2


def test_a_cache_behind_a_file_says_which_directory(tmp_path: Path) -> None:
    """Caught at the agent's start, which then reports it is not ready."""
    (tmp_path / "parent").write_text("a file where the cache's parent should be")
    cache_dir = tmp_path / "parent" / "cache"
    with pytest.raises(OSError, match=f"adapter cache '{re.escape(str(cache_dir))}' cannot be"):
        AdapterCache(str(cache_dir)).check_writable()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in read-only directories")
@pytest.mark.parametrize("where", ["the cache", "its parent"])
def test_a_read_only_cache_says_which_directory(tmp_path: Path, where: str) -> None:
    parent = tmp_path / "parent"
    cache_dir = parent / "cache"
    cache_dir.mkdir(parents=True)
    locked = cache_dir if where == "the cache" else parent
    if where == "its parent":
        cache_dir.rmdir()
    locked.chmod(0o555)
    try:
        said = f"adapter cache '{re.escape(str(cache_dir))}' cannot be written"
        with pytest.raises(OSError, match=said):
            AdapterCache(str(cache_dir)).check_writable()
    finally:
        locked.chmod(0o755)


async def test_a_node_hashes_an_entry_once_per_update_not_once_per_agent(
    store: Store, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent that fetched an entry hashed it; the node's other agents
    (another cache on the same directory) and the load that follows the
    prepare take its unchanged files without reading them again, for a
    while; a file changed since is found, and after the node rebooted (the
    files are not synced: a reboot may have lost their last writes), or
    once that while is over, every use hashes again."""
    import lorabus.agents.adapter_cache as module

    hashed: list[str] = []
    real = module.adapter_digest

    def counting(directory: str) -> str:
        hashed.append(directory)
        return real(directory)

    monkeypatch.setattr(module, "adapter_digest", counting)
    digest = store.add(b"weights")
    fetcher, neighbour = AdapterCache(str(cache_dir)), AdapterCache(str(cache_dir))
    # Fetched: hashed as it was unpacked, not read again.
    entry = await fetcher.get(digest, store.fetch, timeout_s=10)
    after_fetch = len(hashed)
    await neighbour.get(digest, store.fetch, timeout_s=10)  # another agent of the node
    await fetcher.get(digest, store.fetch, timeout_s=10)  # the load after the prepare
    after_uses = len(hashed)
    _change(Path(entry), "a file changed")
    await neighbour.get(digest, store.fetch, timeout_s=10)  # found changed: fetched again
    after_change = len(hashed)
    monkeypatch.setattr(module, "_boot_id", lambda: "the next boot")
    await neighbour.get(digest, store.fetch, timeout_s=10)  # rebooted: hashed again
    after_reboot = len(hashed)
    monkeypatch.setattr(module, "_TRUST_HASH_S", 0.0)
    await neighbour.get(digest, store.fetch, timeout_s=10)  # later: hashed again

    assert (after_fetch, after_uses - after_fetch) == (0, 0)
    assert store.fetches == [digest, digest], "the changed entry was served"
    assert after_reboot - after_change == 1
    assert len(hashed) - after_reboot == 1
    assert real(entry) == digest
