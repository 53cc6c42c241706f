"""Adapters from the object store on a three-node NATS cluster: the store is
replicated as the KV buckets are, and a node that crashes while agents are
fetching from it, then starts again on its own store, leaves the update
committed or failed cleanly (``fetch_failed``, no engine paused), never a
half-fetched adapter in a cache, and the fleet able to commit the next update.

Three nats-servers of the test's own (it kills one), each with its monitoring
port, so that the test kills the node that fetching agents are connected to:
the loss a transfer must survive. SIGKILL, not a polite stop: nothing in flight
is flushed, and the node starts again on a store it did not close. The agents
are as on separate nodes: each with a cache directory of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import nats.errors
import nats.js.errors
import pytest

from lorabus.adapters.digest import adapter_digest
from lorabus.bus.connect import close, connect
from lorabus.schemas import ErrorCode, Subjects, UpdateResult
from lorabus.testbed.natsserver import NatsServer, free_port
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 60.0
WEIGHTS_MIB = 64
"""Large enough that three agents fetching it on the loopback take a second
or more, so that the node dies in the middle of the transfer."""
MID_TRANSFER_BYTES = 4 << 20
"""A fetch is under way once the folder it unpacks into under ``.partial/`` holds this much."""
WORKERS = {"w000", "w001", "w002"}
_ENTRY = re.compile(r"^[0-9a-f]{64}$")


class Node:
    """A cluster node, with its monitoring port to see who is connected to it."""

    def __init__(self, server: NatsServer, monitor_port: int) -> None:
        self.server = server
        self.monitor_url = f"http://127.0.0.1:{monitor_port}"

    async def client_names(self) -> set[str]:
        async with httpx.AsyncClient(timeout=5) as http:
            reply = await http.get(f"{self.monitor_url}/connz", params={"limit": 1024})
        reply.raise_for_status()
        return {c.get("name", "") for c in reply.json().get("connections") or []}

    def crash(self) -> None:
        """SIGKILL, and wait for it; the store stays, for the node to start again on."""
        process = self.server.process
        assert process is not None
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)


@pytest.fixture
async def cluster() -> AsyncIterator[list[Node]]:
    cluster_ports = [free_port() for _ in range(3)]
    with tempfile.TemporaryDirectory(prefix="lorabus-cluster-") as store:
        nodes = []
        for i, port in enumerate(cluster_ports):
            monitor_port = free_port()
            server = NatsServer(
                store_dir=f"{store}/n{i}",
                name=f"n{i}",
                cluster_port=port,
                routes=[p for p in cluster_ports if p != port],
                options=["-m", str(monitor_port)],
            )
            nodes.append(Node(server, monitor_port))
        try:
            await asyncio.gather(*(node.server.start() for node in nodes))
            yield nodes
        finally:
            for node in nodes:
                node.server.stop()


def write_large_adapter(directory: Path) -> str:
    """A PEFT adapter's two files, the weights ``WEIGHTS_MIB`` MiB of random bytes."""
    directory.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 8, "target_modules": ["q_proj", "v_proj"]}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    with (directory / "adapter_model.safetensors").open("wb") as weights:
        for _ in range(WEIGHTS_MIB):
            weights.write(os.urandom(1 << 20))
    return str(directory)


def caches_of(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def fetching(root: Path) -> set[str]:
    """The workers with a fetch under way: the folder it unpacks into, under
    ``.partial``, holds ``MID_TRANSFER_BYTES`` or more."""
    found = set()
    for cache in caches_of(root):
        partial = cache / ".partial"
        for item in partial.iterdir() if partial.is_dir() else ():
            try:
                files = item.rglob("*") if item.is_dir() else [item]
                if sum(f.stat().st_size for f in files if f.is_file()) >= MID_TRANSFER_BYTES:
                    found.add(cache.name)
            except FileNotFoundError:  # renamed into place or removed meanwhile
                pass
    return found


async def wait_fetching(root: Path) -> set[str]:
    """The workers fetching, once one is; fails after the deadline."""
    async with asyncio.timeout(DEADLINE_S):
        while True:
            if found := fetching(root):
                return found
            await asyncio.sleep(0.005)


def holds(root: Path, worker: str, digest: str) -> bool:
    return (root / worker / digest.removeprefix("sha256:")).exists()


def pauses(stack: EmbeddedStack) -> int:
    assert stack.sim is not None
    return sum(
        w.count_requests("POST", "/engine/pause_generation") for w in stack.sim.workers.values()
    )


async def update_until_terminal(
    stack: EmbeddedStack, digest: str, version: int, update_id: str
) -> UpdateResult:
    """Ask, and ask again with the same id while nobody could answer (a leader
    or a client connected to the node that died)."""
    assert stack.client is not None
    while True:
        result = await stack.client.update(
            "policy", digest=digest, version=version, update_id=update_id, timeout_s=20
        )
        if result.error is None or result.error.code not in (
            ErrorCode.TIMEOUT,
            ErrorCode.NO_COORDINATOR,
            ErrorCode.NOT_LEADER,
        ):
            return result


async def stream_infos(urls: str, *streams: str) -> list[Any]:
    nc = await connect(urls, name="test-stream-reader")
    try:
        return [await nc.jetstream().stream_info(stream) for stream in streams]
    finally:
        await close(nc)


async def wait_replicas_current(urls: str, stream: str) -> Any:
    """The stream's info once both followers are online and caught up; fails
    after the deadline (the node that died must rejoin the stream's group).
    A node that has just started may not answer JetStream at once: asked again."""
    nc = await connect(urls, name="test-stream-watcher")
    try:
        async with asyncio.timeout(DEADLINE_S):
            while True:
                with contextlib.suppress(nats.errors.TimeoutError, nats.js.errors.APIError):
                    info = await nc.jetstream().stream_info(stream)
                    replicas = (info.cluster.replicas if info.cluster else None) or []
                    if len(replicas) == 2 and all(r.current and not r.offline for r in replicas):
                        return info
                await asyncio.sleep(0.2)
    finally:
        await close(nc)


async def test_a_node_crashing_mid_fetch_leaves_the_update_committed_or_cleanly_failed(
    cluster: list[Node], fleet_name: str, tmp_path: Path
) -> None:
    urls = ",".join(node.server.url for node in cluster)
    subjects = Subjects(fleet=fleet_name)
    object_stream = f"OBJ_{subjects.adapter_store()}"
    caches = tmp_path / "nodes"
    async with EmbeddedStack(
        [1, 1, 1],
        fleet=fleet_name,
        nats_url=urls,
        heartbeat_s=0.2,
        cache_root=str(caches),
        prepare_timeout_s=30,
        phase_timeout_s=15,
        pause_lease_s=10,
        kv_replicas=3,
    ) as stack:
        assert stack.client is not None
        store, state = await stream_infos(urls, object_stream, f"KV_{subjects.state_bucket()}")
        digest = await stack.client.push_adapter(write_large_adapter(tmp_path / "adapter"))
        during = asyncio.create_task(update_until_terminal(stack, digest, 1, "node-crashes"))
        under_way = await wait_fetching(caches)
        connected = [await node.client_names() for node in cluster]
        agents = {f"lorabus-agent-{w}" for w in under_way}
        most = max(range(len(cluster)), key=lambda i: len(connected[i] & agents))
        victim = cluster[most]
        victim.crash()
        on_victim = {w for w in WORKERS if f"lorabus-agent-{w}" in connected[most]}
        cut_short = {w for w in on_victim if not holds(caches, w, digest)}
        await victim.server.start()  # on the store it had
        result = await asyncio.wait_for(during, DEADLINE_S)
        paused_for_it = pauses(stack)
        after = await asyncio.wait_for(
            update_until_terminal(stack, digest, 2, "after-the-node-came-back"), DEADLINE_S
        )
        assert stack.sim is not None
        still_paused = [w.worker_id for w in stack.sim.workers.values() if w.paused]
        rejoined = await wait_replicas_current(urls, object_stream)

    assert store.config.num_replicas == state.config.num_replicas == 3
    assert cut_short & under_way, "no fetch was under way on the node that died"
    assert result.status in ("committed", "failed"), result
    if not result.committed:
        codes = {w: o.error.code for w, o in result.workers.items() if o.error is not None}
        assert codes, result.error
        assert set(codes.values()) <= {ErrorCode.FETCH_FAILED, ErrorCode.PHASE_TIMEOUT}, codes
        # Only an agent whose own connection was on that node is counted as
        # lost (it stops beating while it moves, maybe before its fetch fails).
        lost = {w for w, code in codes.items() if code is ErrorCode.PHASE_TIMEOUT}
        assert lost <= on_victim, (codes, on_victim)
        assert paused_for_it == 0, "an engine was paused for an update whose fetch failed"
    assert after.committed, after.error
    assert still_paused == []
    peers = {rejoined.cluster.leader, *(r.name for r in rejoined.cluster.replicas)}
    assert peers == {"n0", "n1", "n2"}, f"{victim.server.name} did not rejoin: {peers}"
    for worker in sorted(WORKERS):
        cache = caches / worker
        found = [item for item in cache.iterdir() if _ENTRY.match(item.name)]
        assert [item.name for item in found] == [digest.removeprefix("sha256:")], (worker, found)
        assert adapter_digest(found[0]) == digest, f"{found[0]} is not what its name says"
        leftovers = list((cache / ".partial").iterdir())
        assert leftovers == [], f"{worker} left partial files: {leftovers}"


async def test_a_fetch_whose_node_dies_goes_on_from_another_node(
    cluster: list[Node], fleet_name: str, tmp_path: Path
) -> None:
    """The reader's own node is killed while chunks stream to it, most likely
    inside a batch: the fetch asks again from the last chunk it wrote, on the
    node its connection moved to, and ends with every byte, once."""
    from lorabus.adapters.fetch import fetch_object
    from lorabus.adapters.store import push_adapter, store_config

    subjects = Subjects(fleet=fleet_name)
    urls = [node.server.url for node in cluster]
    writer = await connect(",".join(urls), name="test-pusher")
    reader = await connect(",".join(urls), name="test-reader")
    try:
        config = store_config(subjects, replicas=3)
        async with asyncio.timeout(DEADLINE_S):
            # A new cluster elects its JetStream leader, then the stream its own.
            while True:
                with contextlib.suppress(TimeoutError, nats.errors.Error):
                    stream = await writer.jetstream().add_stream(config)
                    if stream.cluster and stream.cluster.leader:
                        break
                await asyncio.sleep(0.1)
        digest, _ = await push_adapter(writer, subjects, write_large_adapter(tmp_path / "a"))
        (reader_node,) = [n for n in cluster if "test-reader" in await n.client_names()]
        into = tmp_path / "fetched.tar"
        with into.open("wb") as file:
            fetching_ = asyncio.ensure_future(
                fetch_object(
                    reader, subjects, digest, file, timeout_s=DEADLINE_S, max_bytes=1 << 30
                )
            )
            async with asyncio.timeout(DEADLINE_S):
                while into.stat().st_size < MID_TRANSFER_BYTES:  # noqa: ASYNC110
                    await asyncio.sleep(0.002)
            reader_node.crash()
            size = await fetching_
    finally:
        await close(reader)
        await close(writer)

    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    from lorabus.adapters.archive import unpack

    unpack(str(into), str(unpacked))
    assert size == into.stat().st_size
    assert adapter_digest(unpacked) == digest
