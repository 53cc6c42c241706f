"""Housekeeping never fails an update: the node's adapter cache is pruned
beside the agent's commands, never inside one, so a prune that meets an
entry renamed away mid-scan, or that fails outright, and a holder file that
cannot be written, leave every load's ack ok. A failure is logged once while
it lasts, counted, and tried again until it works.

The engine is the in-memory one of tests/memory_fleet.py; the cache and its
files are real. Each wait is on a signal (the keeper counting a prune or a
failure), bounded only to fail instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from cache_doubles import Store
from memory_fleet import MemoryEngine

from lorabus.adapters.bus_paths import bus_path
from lorabus.agents import CommandExecutor
from lorabus.agents.adapter_cache import AdapterCache
from lorabus.agents.cache_holders import CacheKeeper
from lorabus.schemas import LoadCommand, UnloadCommand

DEADLINE_S = 10.0


class Counts:
    """The keeper's counts, with a signal at each."""

    def __init__(self) -> None:
        self.removed: list[int] = []
        self.failed: list[str] = []
        self.changed = asyncio.Event()

    def cache_pruned(self, removed: int) -> None:
        self.removed.append(removed)
        self.changed.set()

    def cache_failed(self, operation: str) -> None:
        self.failed.append(operation)
        self.changed.set()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(DEADLINE_S):
            while not condition():
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path)


@asynccontextmanager
async def agent(
    cache_dir: Path, store: Store, counts: Counts
) -> AsyncIterator[tuple[CommandExecutor, CacheKeeper]]:
    """An executor and its keeper, pruning in the background as an agent's
    task does (and tried again at once after a failure)."""
    cache = AdapterCache(str(cache_dir), keep=0)
    keeper = CacheKeeper(cache, holder="fleet-a.w0", counts=counts)
    executor = CommandExecutor("w0", 1, MemoryEngine(), adapter_cache=cache, cache_keeper=keeper)
    executor.store_loads.fetch = store.fetch
    async with asyncio.TaskGroup() as tasks:
        pruning = tasks.create_task(keeper.run(retry_s=0.001))
        try:
            yield executor, keeper
        finally:
            pruning.cancel()


def load(version: int, digest: str) -> LoadCommand:
    name = f"policy-v{version}"
    return LoadCommand(update_id=name, budget_s=10, served_name=name, path=bus_path(digest))


def retire(version: int) -> UnloadCommand:
    return UnloadCommand(update_id="retire", budget_s=10, names=[f"policy-v{version}"])


def entries(cache_dir: Path) -> set[str]:
    return {f"sha256:{p.name}" for p in cache_dir.iterdir() if not p.name.startswith(".")}


class RenamedAwayMidScan:
    """``os.scandir`` as another agent's prune makes it look: ``digest``'s entry
    is renamed away between its listing and its ``stat``; ``counted`` is how
    many prunes the keeper had counted then."""

    def __init__(self, cache_dir: Path, digest: str, elsewhere: Path, counts: Counts) -> None:
        self.cache_dir, self.elsewhere, self.counts = cache_dir, elsewhere, counts
        self.name = digest.removeprefix("sha256:")
        self.counted: int | None = None
        self._scandir = os.scandir

    def __call__(self, path: str | int) -> Iterator[object]:
        listed = self._scandir(path)
        if path != str(self.cache_dir):
            return listed
        return iter([self._taken(item) if item.name == self.name else item for item in listed])

    def _taken(self, item: os.DirEntry[str]) -> object:
        scan = self

        class Taken:
            name, path = item.name, item.path

            def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
                if scan.counted is None:
                    os.rename(self.path, scan.elsewhere / self.name)
                    scan.counted = len(scan.counts.removed)
                return os.stat(self.path, follow_symlinks=follow_symlinks)

        return Taken()


def unreadable(cache_dir: Path) -> Callable[[str | int], Iterator[os.DirEntry[str]]]:
    """``os.scandir`` of a cache this agent may no longer read."""
    real_scandir = os.scandir

    def scandir(path: str | int) -> Iterator[os.DirEntry[str]]:
        if path == str(cache_dir):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    return scandir


async def test_a_prune_that_meets_an_entry_renamed_away_fails_no_load(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry no engine holds is taken by another agent's prune while this
    one looks at it: no failure at all, and never the ack's."""
    cache_dir, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    elsewhere.mkdir()
    counts = Counts()
    stray, first, second = store.add(b"stray"), store.add(b"first"), store.add(b"second")
    await AdapterCache(str(cache_dir)).get(stray, store.fetch, timeout_s=10)
    scan = RenamedAwayMidScan(cache_dir, stray, elsewhere, counts)
    monkeypatch.setattr(os, "scandir", scan)
    async with agent(cache_dir, store, counts) as (executor, _):
        assert (await executor.execute(load(1, first), 10)).ok
        assert (await executor.execute(load(2, second), 10)).ok
        # The prune that met the renamed entry ended, and counted no failure.
        await counts.wait_until(
            lambda: scan.counted is not None and len(counts.removed) > scan.counted
        )

    assert counts.failed == []
    assert executor.adapters == ["policy-v1", "policy-v2"]
    assert entries(cache_dir) == {first, second}
    assert (elsewhere / stray.removeprefix("sha256:")).is_dir()


async def test_a_prune_that_fails_fails_no_load_and_is_tried_again_until_it_works(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache_dir = tmp_path / "cache"
    counts = Counts()
    first, second = store.add(b"first"), store.add(b"second")
    caplog.set_level(logging.INFO, logger="lorabus.agents.cache_holders")
    async with agent(cache_dir, store, counts) as (executor, _):
        monkeypatch.setattr(os, "scandir", unreadable(cache_dir))
        for command, is_retire in (
            (load(1, first), False),
            (retire(1), True),
            (load(2, second), False),
        ):
            ack = await executor.execute(command, 10, retire=is_retire)
            assert ack.ok, ack.error
        await counts.wait_until(lambda: counts.failed.count("prune") >= 3)
        assert entries(cache_dir) == {first, second}  # nothing pruned yet
        monkeypatch.undo()
        await counts.wait_until(lambda: first not in entries(cache_dir) and bool(counts.removed))

    assert entries(cache_dir) == {second}
    said = [r.getMessage() for r in caplog.records if ": pruning" in r.getMessage()]
    assert len(said) == 2, said  # when it started failing, and when it worked again
    assert "failed, to be tried again" in said[0] and "Permission denied" in said[0]
    assert said[1].endswith("works again")


async def test_a_holder_file_that_cannot_be_written_fails_no_load(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Written again at the next change, or the next prune, once it can be."""
    caplog.set_level(logging.INFO, logger="lorabus.agents.cache_holders")
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / ".holders").write_text("a file where the holders' folder should be")
    counts = Counts()
    first = store.add(b"first")
    async with agent(cache_dir, store, counts) as (executor, _):
        assert (await executor.execute(load(1, first), 10)).ok
        assert "hold" in counts.failed
        (cache_dir / ".holders").unlink()
        await counts.wait_until(lambda: (cache_dir / ".holders" / "fleet-a.w0.json").exists())
    warned = [r for r in caplog.records if "writing the holder file" in r.getMessage()]
    assert [r.levelno for r in warned] == [logging.WARNING, logging.INFO]


async def test_an_entry_that_may_not_be_removed_is_said_once_counted_and_tried_again(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache_dir = tmp_path / "cache"
    stray, first, second = store.add(b"stray"), store.add(b"first"), store.add(b"second")
    await AdapterCache(str(cache_dir)).get(stray, store.fetch, timeout_s=10)
    real_rename = os.rename

    def rename(source: str, target: str) -> None:
        if os.path.basename(source) == stray.removeprefix("sha256:"):
            raise PermissionError(1, "Operation not permitted", source)
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", rename)
    counts = Counts()
    async with agent(cache_dir, store, counts) as (executor, _):
        await counts.wait_until(lambda: "remove" in counts.failed)
        pruned = len(counts.removed)
        assert (await executor.execute(load(1, first), 10)).ok  # what is held changed: a prune
        await counts.wait_until(lambda: len(counts.removed) > pruned)
        assert stray in entries(cache_dir)
        monkeypatch.undo()
        assert (await executor.execute(load(2, second), 10)).ok
        await counts.wait_until(
            lambda: stray not in entries(cache_dir) and bool(counts.removed[-1])
        )

    assert counts.failed == ["remove"]
    said = [r.getMessage() for r in caplog.records if "cannot remove" in r.getMessage()]
    assert len(said) == 1 and "Operation not permitted" in said[0], said
