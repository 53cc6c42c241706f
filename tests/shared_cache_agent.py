"""One agent process of a node whose agents share one adapter cache, for
tests/test_shared_cache_agents.py.

It runs the real :class:`~lorabus.agents.CommandExecutor` over a real
:class:`~lorabus.agents.adapter_cache.AdapterCache` and its
:class:`~lorabus.agents.cache_holders.CacheKeeper` (pruning in the
background, as an agent does), with ``keep=0`` so that every prune removes
all it may. Its engine (:class:`FileEngine`) keeps what it serves in a file,
so it serves on when this process exits and the next one takes over, as an
engine outlives a restarted agent. The process says ``ready``, waits for the
test's ``go`` on stdin, prunes once (as another agent of the node may, at the
worst moment: before this one knows what its engine serves), then loads a
version per step from the pool of adapters and retires those older than the
last two, pruning again after each step. It prints one JSON line: the acks
that failed and how many entries its prunes removed.

Usage: shared_cache_agent.py SPEC_JSON (see :func:`main`).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
from typing import Any

from lorabus.adapters.archive import pack
from lorabus.adapters.bus_paths import bus_path
from lorabus.adapters.fetch import ChunkSink
from lorabus.agents import CommandExecutor
from lorabus.agents.adapter_cache import AdapterCache
from lorabus.agents.cache_holders import CacheKeeper
from lorabus.errors import EngineError
from lorabus.schemas import LoadCommand, UnloadCommand

CRASHED = 3
"""The exit code of a process that died, as planned, in its engine's load."""


class FileEngine:
    """An engine whose state outlives the agent process: served name -> the
    directory it loaded and that directory's inode. As vLLM reads an adapter
    from its path again after evicting it, every call checks that each
    served directory is still the one it loaded, and appends to the
    violations file when one is not."""

    kind = "memory"

    def __init__(self, state: str, violations: str, *, crash_loading: str = "") -> None:
        self.state = state
        self.violations = violations
        self.crash_loading = crash_loading

    def _read(self) -> dict[str, list[object]]:
        try:
            with open(self.state) as file:
                return dict(json.load(file))
        except FileNotFoundError:
            return {}

    def _save(self, served: dict[str, list[object]]) -> None:
        with open(self.state + ".new", "w") as file:
            json.dump(served, file)
        os.replace(self.state + ".new", self.state)

    def _check(self, served: dict[str, list[object]]) -> None:
        for name, (path, inode) in served.items():
            try:
                found = os.stat(str(path)).st_ino
            except FileNotFoundError:
                found = None
            if found != inode:
                with open(self.violations, "a") as file:
                    file.write(f"{name} served from {path}: removed under the engine\n")

    async def pause(self) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def load_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        served = self._read()
        self._check(served)
        try:
            served[name] = [path, os.stat(path).st_ino]
        except FileNotFoundError as exc:
            raise EngineError(f"cannot load {name}: {path} is gone") from exc
        self._save(served)
        if name == self.crash_loading:
            os._exit(CRASHED)  # loaded, and the agent dies before it hears so

    async def unload_adapter(self, name: str) -> None:
        served = self._read()
        served.pop(name, None)
        self._save(served)

    async def list_adapters(self) -> list[str]:
        served = self._read()
        self._check(served)
        return list(served)

    async def aclose(self) -> None:
        return None


class Counts:
    def __init__(self) -> None:
        self.removed = 0
        self.failed: list[str] = []

    def cache_pruned(self, removed: int) -> None:
        self.removed += removed

    def cache_failed(self, operation: str) -> None:
        self.failed.append(operation)


def _version(name: str) -> int:
    return int(name.rsplit("-v", 1)[1])


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    pool: dict[str, str] = spec["pool"]
    digests = sorted(pool)
    worker, fleet = spec["worker"], spec["fleet"]
    first, steps = spec["first_version"], spec["steps"]
    cache = AdapterCache(spec["cache_dir"], keep=0)
    counts = Counts()
    keeper = CacheKeeper(cache, holder=f"{fleet}.{worker}", counts=counts)
    engine = FileEngine(spec["engine_state"], spec["violations"], crash_loading=spec["crash"])
    executor = CommandExecutor(worker, 1, engine, adapter_cache=cache, cache_keeper=keeper)

    async def fetch(digest: str, into: ChunkSink, *, store: str = "") -> int:
        packed = io.BytesIO()
        pack(pool[digest], packed)
        await asyncio.to_thread(into.write, packed.getvalue())
        return len(packed.getvalue())

    executor.store_loads.fetch = fetch
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # the test's go
    failed: list[str] = []
    async with asyncio.TaskGroup() as tasks:
        pruning = tasks.create_task(keeper.run())
        pruned = len(await asyncio.to_thread(cache.prune))
        await executor.refresh()
        for version in range(first, first + steps):
            digest = digests[(spec["index"] + version) % len(digests)]
            load = LoadCommand(
                update_id=f"u{version}",
                targets=[worker],
                budget_s=60,
                served_name=f"p-v{version}",
                path=bus_path(digest),
            )
            ack = await executor.execute(load, 60)
            if not ack.ok:
                failed.append(f"load p-v{version}: {ack.error}")
            old = [name for name in executor.adapters if _version(name) <= version - 2]
            if old:
                unload = UnloadCommand(
                    update_id=f"u{version}", targets=[worker], budget_s=10, names=old
                )
                ack = await executor.execute(unload, 10, retire=True)
                if not ack.ok:
                    failed.append(f"retire {old}: {ack.error}")
            pruned += len(await asyncio.to_thread(cache.prune))
        pruning.cancel()
    return {"failed": failed, "removed": counts.removed + pruned, "errors": counts.failed}


def main() -> None:
    """SPEC_JSON: ``cache_dir``, ``pool`` (digest -> adapter directory),
    ``fleet``, ``worker``, ``index`` (spreads the workers over the pool),
    ``engine_state``, ``violations`` (files), ``first_version``, ``steps``,
    ``crash`` (the served name whose load kills this process; "" for none)."""
    print(json.dumps(asyncio.run(run(json.loads(sys.argv[1])))), flush=True)


if __name__ == "__main__":
    main()
