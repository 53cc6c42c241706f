"""No prune removes an entry of a node's adapter cache that an engine of the
node may serve: whichever agent prunes, of whichever fleet, and across a
restart of the agent that holds it. What each agent's engine holds lives in
a holder file of its own (``.holders/<fleet>.<worker>.json``), written before
a fetch and whenever the engine's list changes; one not rewritten for a day
holds nothing, and one that cannot be read stops every removal.

Everything on disk is real; the engine is the in-memory one of
tests/memory_fleet.py. Eight agent processes sharing a cache are in
tests/test_shared_cache_agents.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cache_doubles import Store
from memory_fleet import MemoryEngine

from lorabus.adapters.bus_paths import bus_path
from lorabus.agents import CommandExecutor
from lorabus.agents.adapter_cache import AdapterCache
from lorabus.agents.cache_holders import HOLDER_MAX_AGE_S, CacheKeeper
from lorabus.agents.store_loads import PREPARED_KEPT
from lorabus.schemas import LoadCommand, PauseCommand, PrepareCommand

DAY_S = 24 * 3600.0


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def entries(cache_dir: Path) -> set[str]:
    """The digests the cache holds."""
    return {f"sha256:{p.name}" for p in cache_dir.iterdir() if not p.name.startswith(".")}


async def fill(cache_dir: Path, store: Store, count: int) -> list[str]:
    digests = [store.add(bytes([n]) * 64) for n in range(count)]
    cache = AdapterCache(str(cache_dir))
    for digest in digests:
        await cache.get(digest, store.fetch, timeout_s=10)
    return digests


def agent(
    cache_dir: Path, store: Store, engine: MemoryEngine, holder: str = "fleet-a.w0"
) -> CommandExecutor:
    """An agent's executor over the shared cache, as Agent.from_config builds it."""
    cache = AdapterCache(str(cache_dir), keep=0)
    executor = CommandExecutor(
        holder.split(".")[1],
        1,
        engine,
        adapter_cache=cache,
        cache_keeper=CacheKeeper(cache, holder=holder),
    )
    executor.store_loads.fetch = store.fetch
    return executor


def load(name: str, digest: str) -> LoadCommand:
    return LoadCommand(update_id=name, budget_s=10, served_name=name, path=bus_path(digest))


def prune(cache_dir: Path) -> list[str]:
    """A prune of another agent of the node, keeping nothing it may remove."""
    return AdapterCache(str(cache_dir), keep=0).prune()


async def test_a_prune_leaves_what_any_agent_of_any_fleet_holds(
    store: Store, cache_dir: Path
) -> None:
    served, prepared, free = await fill(cache_dir, store, 3)
    cache = AdapterCache(str(cache_dir))
    CacheKeeper(cache, holder="fleet-a.w0").hold({"policy-v1": [served]})
    CacheKeeper(cache, holder="fleet-b.w0").hold({}, prepared=[prepared])

    assert prune(cache_dir) == [free]
    assert entries(cache_dir) == {served, prepared}


@pytest.mark.parametrize(("age_s", "kept"), [(HOLDER_MAX_AGE_S - 3600, True), (2 * DAY_S, False)])
async def test_a_holder_file_not_rewritten_for_a_day_holds_nothing(
    store: Store, cache_dir: Path, age_s: float, kept: bool
) -> None:
    """Its agent rewrites it every few minutes while it runs: one a day old is
    of an agent gone for good. It is left where it is, for an operator."""
    (served,) = await fill(cache_dir, store, 1)
    CacheKeeper(AdapterCache(str(cache_dir)), holder="fleet-a.w0").hold({"policy-v1": [served]})
    holder = cache_dir / ".holders" / "fleet-a.w0.json"
    then = time.time() - age_s
    os.utime(holder, (then, then))

    assert prune(cache_dir) == ([] if kept else [served])
    assert holder.exists()


async def test_a_holder_file_that_cannot_be_read_stops_every_removal(
    store: Store, cache_dir: Path
) -> None:
    """Nobody knows what its engine serves, so nothing goes until it is mended."""
    digests = await fill(cache_dir, store, 2)
    holders = cache_dir / ".holders"
    holders.mkdir()
    (holders / "fleet-a.w0.json").write_text('{"serves": {"policy-v1": ["not a digest"]}}')

    with pytest.raises(ValueError, match=r"fleet-a\.w0\.json cannot be read"):
        prune(cache_dir)
    assert entries(cache_dir) == set(digests)
    (holders / "fleet-a.w0.json").unlink()
    assert sorted(prune(cache_dir)) == sorted(digests)


async def test_a_restarted_agent_holds_what_its_predecessor_held_until_its_engine_says(
    store: Store, cache_dir: Path
) -> None:
    """The engine serves on while its agent restarts: the new agent takes the
    old holder file for its own, whatever it runs before it has read the
    engine's list, and lets go of what the engine no longer lists after."""
    first, second = await fill(cache_dir, store, 2)
    engine = MemoryEngine()
    before = agent(cache_dir, store, engine)
    for name, digest in (("policy-v1", first), ("policy-v2", second)):
        assert (await before.execute(load(name, digest), 10)).ok
    del before  # the agent process is gone; its engine serves on
    engine.adapters.remove("policy-v1")  # and drops a version meanwhile

    after = agent(cache_dir, store, engine)
    assert prune(cache_dir) == []
    pause = PauseCommand(update_id="u", budget_s=10)
    assert (await after.execute(pause, 10)).ok  # no read of the engine's list
    assert prune(cache_dir) == []
    await after.refresh()
    assert prune(cache_dir) == [first]
    assert entries(cache_dir) == {second}


async def test_an_entry_is_held_before_its_load_fetches_it_and_while_the_engine_loads(
    store: Store, cache_dir: Path
) -> None:
    """Another agent's prune, in the middle of the load, leaves the entry the
    engine is reading; reloading a name in place, it leaves the old bytes too
    (the engine may serve them until the load ends), and once the load is
    done it lets them go."""
    old, new = store.add(b"old"), store.add(b"new")
    engine = MemoryEngine()
    executor = agent(cache_dir, store, engine)
    assert (await executor.execute(load("policy", old), 10)).ok
    left_mid_load: list[set[str]] = []

    async def others_prune() -> None:
        prune(cache_dir)
        left_mid_load.append(entries(cache_dir))

    engine.on_load = others_prune
    reload = LoadCommand(
        update_id="u2", budget_s=10, served_name="policy", path=bus_path(new), replace=True
    )
    assert (await executor.execute(reload, 10)).ok

    assert left_mid_load == [{old, new}]
    assert prune(cache_dir) == [old]


async def test_prepared_adapters_are_held_for_their_loads_to_come(
    store: Store, cache_dir: Path
) -> None:
    """Updates of different adapters prepare at once: each prepared adapter is
    held for its load, until as many more prepares have come as a
    coordinator runs updates at once (an update that failed before its load
    holds one a little longer, never for ever)."""
    digests = [store.add(f"adapter {i}".encode()) for i in range(PREPARED_KEPT + 1)]
    executor = agent(cache_dir, store, MemoryEngine())
    for digest in digests:
        prepare = PrepareCommand(
            update_id=digest, budget_s=10, path=bus_path(digest), digest=digest
        )
        assert (await executor.execute(prepare, 10)).ok
    prune(cache_dir)
    assert entries(cache_dir) == set(digests[1:]), "the oldest is let go, the others held"


async def test_an_entry_renamed_away_while_a_prune_looks_is_skipped(
    store: Store, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between ``scandir`` and ``stat`` another agent's prune takes an entry:
    this prune goes on with the others."""
    vanishing, other = await fill(cache_dir, store, 2)
    real_scandir = os.scandir

    class Taken:
        """The entry as scandir listed it, renamed away before its stat."""

        def __init__(self, item: os.DirEntry[str]) -> None:
            self.name, self.path = item.name, item.path

        def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
            os.rename(self.path, tmp_path / "elsewhere")
            return os.stat(self.path, follow_symlinks=follow_symlinks)

    def scandir(path: str | int) -> Iterator[os.DirEntry[str] | Taken]:
        if path != str(cache_dir):
            return real_scandir(path)  # type: ignore[return-value]
        listed = list(real_scandir(path))
        return iter(Taken(item) if f"sha256:{item.name}" == vanishing else item for item in listed)

    monkeypatch.setattr(os, "scandir", scandir)
    assert prune(cache_dir) == [other]
    assert entries(cache_dir) == set()
