"""Eight agents of one node, of two fleets, share one adapter cache: they load
and retire adapters at the same time, restart (one in two dies inside a
load), and prune as hard as they can (``keep=0``, at every step, in the
background, and first thing after each restart). No load fails, and no
entry an engine serves is removed, ever; what is left at the end is exactly
what the engines serve.

Each agent is an OS process of its own (tests/shared_cache_agent.py), since
the cache's locks are ``flock`` locks between processes; its engine keeps its
state in a file, so it serves on while its agent restarts, and checks at
every call that the directories it serves are still the ones it loaded.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from shared_cache_agent import CRASHED

from lorabus.adapters.digest import adapter_digest
from lorabus.agents.adapter_cache import AdapterCache

AGENT = str(Path(__file__).with_name("shared_cache_agent.py"))
AGENTS = [("fleet-a", f"w{n}") for n in range(4)] + [("fleet-b", f"w{n}") for n in range(4)]
"""Two fleets with the same worker ids: a holder file per worker of each fleet."""
ROUNDS, STEPS = 3, 4
DEADLINE_S = 60


def make_pool(root: Path, size: int) -> dict[str, str]:
    pool = {}
    for n in range(size):
        adapter = root / f"adapter{n}"
        adapter.mkdir(parents=True)
        (adapter / "adapter_config.json").write_text('{"r": 8}')
        (adapter / "adapter_model.safetensors").write_bytes(os.urandom(4096) + bytes([n]))
        pool[adapter_digest(adapter)] = str(adapter)
    return pool


async def run_round(specs: list[dict[str, Any]]) -> list[tuple[int | None, bytes, bytes]]:
    """Start every agent, let them all go at once, and wait for their ends."""
    pipe = asyncio.subprocess.PIPE
    started: list[asyncio.subprocess.Process] = []
    try:
        async with asyncio.timeout(DEADLINE_S):
            for spec in specs:
                argv = [sys.executable, AGENT, json.dumps(spec)]
                started.append(
                    await asyncio.create_subprocess_exec(
                        *argv, stdin=pipe, stdout=pipe, stderr=pipe
                    )
                )
            for process in started:
                assert process.stdout is not None
                assert await process.stdout.readline() == b"ready\n"
            ends = await asyncio.gather(*(p.communicate(b"go\n") for p in started))
    finally:
        for process in started:
            if process.returncode is None:
                process.kill()
                await process.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(started, ends, strict=True)]


def served_by_engines(engines: Path) -> dict[str, tuple[str, int]]:
    """(engine, served name) -> (directory, inode when loaded), of every engine."""
    served = {}
    for state in sorted(engines.glob("*.json")):
        for name, (path, inode) in json.loads(state.read_text()).items():
            served[f"{state.stem}/{name}"] = (path, inode)
    return served


@pytest.mark.slow
async def test_agents_sharing_a_cache_never_fail_a_load_nor_lose_a_served_entry(
    tmp_path: Path,
) -> None:
    # Each agent serves two neighbouring adapters of the pool, and its neighbour
    # one of those: at any time some adapters are served by none.
    pool = make_pool(tmp_path / "store", 12)
    cache_dir, engines = tmp_path / "node-cache", tmp_path / "engines"
    engines.mkdir()
    violations = tmp_path / "violations.txt"
    removed = 0
    crashed = []
    for round_ in range(ROUNDS):
        specs = [
            {
                "cache_dir": str(cache_dir),
                "pool": pool,
                "fleet": fleet,
                "worker": worker,
                "index": index,
                "engine_state": str(engines / f"{fleet}.{worker}.json"),
                "violations": str(violations),
                "first_version": round_ * STEPS + 1,
                "steps": STEPS,
                # One agent in two dies in its engine's last load of the first round.
                "crash": f"p-v{STEPS}" if round_ == 0 and index % 2 else "",
            }
            for index, (fleet, worker) in enumerate(AGENTS)
        ]
        for spec, (code, out, err) in zip(specs, await run_round(specs), strict=True):
            who = f"round {round_} {spec['fleet']}.{spec['worker']}"
            if spec["crash"]:
                assert code == CRASHED, f"{who} exited {code}: {err.decode()}"
                crashed.append(who)
                continue
            assert code == 0, f"{who} exited {code}: {err.decode()}"
            outcome = json.loads(out.decode().splitlines()[-1])
            assert outcome["failed"] == [], who
            assert outcome["errors"] == [], f"{who}: housekeeping failed: {err.decode()}"
            removed += outcome["removed"]
        assert not violations.exists(), violations.read_text()

    served = served_by_engines(engines)
    for name, (path, inode) in served.items():
        assert os.stat(path).st_ino == inode, f"{name}: {path} was removed and fetched again"
        assert adapter_digest(path) == f"sha256:{Path(path).name}"
    assert len(crashed) == 4
    assert removed > 0, "nothing was ever pruned: the test proves nothing"
    # One more prune, as hard as any: exactly what the engines serve is left.
    await asyncio.to_thread(AdapterCache(str(cache_dir), keep=0).prune)
    left = {p.name for p in cache_dir.iterdir() if not p.name.startswith(".")}
    assert left == {Path(path).name for path, _ in served.values()}
    holders = sorted(p.name for p in (cache_dir / ".holders").iterdir())
    assert holders == sorted(f"{fleet}.{worker}.json" for fleet, worker in AGENTS)
