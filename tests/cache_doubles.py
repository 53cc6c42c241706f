"""A stand-in for the fleet's object store, for the tests of a node's adapter
cache: it packs, as the real packing code does, the adapter a digest names
(tests/test_adapter_objects.py fetches from a real store)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

from adapter_dirs import write_adapter

from lorabus.adapters.archive import pack
from lorabus.adapters.digest import adapter_digest
from lorabus.adapters.fetch import ChunkSink


class Store:
    """Stands in for the fleet's store: packs the adapter a digest names."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "store"
        self.adapters: dict[str, Path] = {}
        self.fetches: list[str] = []
        self.gate: asyncio.Event | None = None
        self.fetching = asyncio.Event()

    def add(self, weights: bytes) -> str:
        adapter = write_adapter(self.root / str(len(self.adapters)), weights)
        digest = adapter_digest(adapter)
        self.adapters[digest] = adapter
        return digest

    async def fetch(self, digest: str, into: ChunkSink, *, store: str = "") -> int:
        """As the bus's fetch does: the object's bytes in chunks, each written
        from a thread (a write unpacks the chunk to disk)."""
        self.fetches.append(digest)
        self.fetching.set()
        if self.gate is not None:
            await self.gate.wait()
        packed = io.BytesIO()
        pack(self.adapters[digest], packed)
        data = packed.getvalue()
        for start in range(0, len(data), 64 << 10):
            await asyncio.to_thread(into.write, data[start : start + (64 << 10)])
        return len(data)
