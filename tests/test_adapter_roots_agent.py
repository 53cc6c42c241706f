"""An agent with adapter roots checks every load's path on its own host, and every
served name, before its engine hears of it.

A hand-played coordinator sends the commands over a real nats-server to a
real agent, whose engine is a simulated Dynamo worker over real HTTP; what
the worker received is read from its request log.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from hand_coordinator import EPOCH, HandCoordinator, real_agent

from lorabus.agents import AgentConfig
from lorabus.schemas import Ack, ErrorCode, LoadCommand, UnloadCommand
from lorabus.simfleet import SimFleet, SimWorker
from lorabus.testbed.trainer import write_adapter

WORKER = "w000"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The agent's adapter root: reached through a symlink, as a "current" link would be."""
    real = tmp_path / "adapters"
    real.mkdir()
    (tmp_path / "current").symlink_to(real)
    return tmp_path / "current"


@pytest.fixture
async def worker(
    nats_url: str,
    fleet_name: str,
    hand: HandCoordinator,
    root: Path,
    start_sim: Callable[..., Awaitable[SimFleet]],
) -> AsyncIterator[SimWorker]:
    """The simulated engine of one agent that has ``root`` as its adapter root."""
    sim = await start_sim({WORKER: 1})
    await hand.lead(EPOCH)
    config = AgentConfig(
        fleet=fleet_name,
        worker_id=WORKER,
        system_url=sim.system_url(WORKER),
        heartbeat_s=0.2,
        adapter_roots=[str(root)],
    )
    async with real_agent(nats_url, config, sim, "test-rooted-agent") as engine:
        yield engine


async def _load(hand: HandCoordinator, path: str | Path, name: str = "policy-v1") -> Ack:
    update_id = f"load-{uuid.uuid4().hex[:8]}"
    await hand.send(
        LoadCommand(
            update_id=update_id,
            targets=[WORKER],
            budget_s=5,
            epoch=EPOCH,
            served_name=name,
            path=str(path),
        )
    )
    return await hand.next_ack(update_id)


def _engine_calls(worker: SimWorker) -> list[tuple[str, str]]:
    """What the engine was asked, less the agent's periodic adapter list."""
    return [(r.method, r.raw_path) for r in worker.requests if r.method != "GET"]


def _refused(ack: Ack, code: ErrorCode) -> str:
    assert not ack.ok and ack.error is not None, ack
    assert ack.error.code == code, ack.error
    assert ack.worker_id == WORKER
    return ack.error.message


async def test_a_symlink_in_the_root_to_an_adapter_outside_is_refused_and_never_loaded(
    hand: HandCoordinator,
    worker: SimWorker,
    root: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    outside = write_adapter(tmp_path / "elsewhere", 1)
    (root / "step_1").symlink_to(outside)

    with caplog.at_level(logging.WARNING, logger="lorabus.agents.executor"):
        ack = await _load(hand, root / "step_1")

    message = _refused(ack, ErrorCode.PATH_REFUSED)
    assert f"{WORKER} refused the load" in message
    assert "outside the adapter roots" in message and str(outside) in message
    assert _engine_calls(worker) == [] and worker.adapters == {}
    assert any("path_refused" in r.getMessage() for r in caplog.records), caplog.text


async def test_a_dotdot_path_out_of_the_root_is_refused(
    hand: HandCoordinator, worker: SimWorker, root: Path, tmp_path: Path
) -> None:
    write_adapter(tmp_path / "elsewhere", 1)

    ack = await _load(hand, f"{root}/../elsewhere/step_1")

    assert "outside the adapter roots" in _refused(ack, ErrorCode.PATH_REFUSED)
    assert _engine_calls(worker) == [] and worker.adapters == {}


async def test_a_directory_without_an_adapter_config_is_refused(
    hand: HandCoordinator, worker: SimWorker, root: Path
) -> None:
    notes = root / "notes"
    notes.mkdir()
    (notes / "adapter_model.safetensors").write_bytes(b"")

    ack = await _load(hand, notes)

    assert "holds no adapter_config.json" in _refused(ack, ErrorCode.PATH_REFUSED)
    assert _engine_calls(worker) == []


async def test_the_engine_is_handed_the_resolved_path(
    hand: HandCoordinator, worker: SimWorker, root: Path, tmp_path: Path
) -> None:
    write_adapter(root, 1)
    (root / "latest").symlink_to(root / "step_1")  # a link that stays inside

    ack = await _load(hand, root / "latest")

    assert ack.ok, ack.error
    real = tmp_path / "adapters" / "step_1"  # the root's target, the link's target
    loads = [r.body for r in worker.requests if r.method == "POST"]
    assert loads == [{"lora_name": "policy-v1", "source": {"uri": real.as_uri()}}]
    assert "policy-v1" in worker.adapters


@pytest.mark.parametrize(
    "name", ["../../engine/pause_generation", "a/../../engine/pause_generation", "p?x", "p#x"]
)
async def test_a_load_under_a_traversal_name_never_reaches_the_engine(
    hand: HandCoordinator, worker: SimWorker, root: Path, name: str
) -> None:
    adapter = write_adapter(root, 1)

    ack = await _load(hand, adapter, name=name)

    assert "served name" in _refused(ack, ErrorCode.BAD_REQUEST)
    assert _engine_calls(worker) == [] and not worker.paused


async def test_an_unload_of_a_traversal_name_never_reaches_another_route(
    hand: HandCoordinator, worker: SimWorker
) -> None:
    evil = "a/../../engine/pause_generation"
    worker.add_adapter(evil)  # listed by the engine, so the agent would unload it

    await hand.send(
        UnloadCommand(update_id="unload-1", targets=[WORKER], budget_s=5, epoch=EPOCH, names=[evil])
    )
    ack = await hand.next_ack("unload-1")

    assert "served name" in _refused(ack, ErrorCode.BAD_REQUEST)
    assert _engine_calls(worker) == [] and not worker.paused
