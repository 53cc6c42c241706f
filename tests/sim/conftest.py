"""Fixtures for the simulated fleet's tests: a started fleet, a client, adapter dirs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from lorabus.simfleet import SimFleet

API_KEY = "sim-secret"


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    """Three workers w000..w002 with world sizes 1, 2, 1, started on a free port."""
    async with SimFleet.of_size(3, world_sizes=(1, 2)) as started:
        yield started


@pytest.fixture
async def secured_sim() -> AsyncIterator[SimFleet]:
    async with SimFleet.of_size(2, api_key=API_KEY) as started:
        yield started


@pytest.fixture
async def client(sim: SimFleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10.0) as http:
        yield http


@pytest.fixture
def adapter_uri(tmp_path: Path) -> Callable[..., str]:
    """Write a (fake) PEFT adapter directory and return its ``file://`` URI."""

    def make(name: str = "adapter", *, config: bool = True, weights: bool = True) -> str:
        directory = tmp_path / name
        directory.mkdir(parents=True)
        if config:
            (directory / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
        if weights:
            (directory / "adapter_model.safetensors").write_bytes(b"not real weights")
        return f"file://{directory}"

    return make
