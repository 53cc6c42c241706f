"""One agent per node: ``lorabus agent --node-file`` drives several workers.

Real processes on a real nats-server over simulated engines (real HTTP
servers): a node agent of three workers beside a lone agent, one fleet. The
coordinator's view stays per worker (members, world sizes, rank map), the
node's acks and beats arrive batched on its node's subject, one engine
failing fails only its worker, and the node's process dying takes its
workers out together, its engines left running.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from nats.aio.msg import Msg
from processes import Processes, run_lorabus, wait_live_workers

from lorabus.agents import AgentConfig
from lorabus.client import UpdateClient
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.schemas import NodeAcks, NodeBeats, ack_message_decoder, beat_message_decoder
from lorabus.simfleet import SimFleet
from lorabus.testbed.natsserver import free_port

pytestmark = pytest.mark.slow

NODE_WORKERS = {"w000": 1, "w001": 2, "w002": 1}
LONE = "w003"
DEADLINE_S = 30.0


def node_file(path: Path, sim: SimFleet, node: str = "gpu-a") -> Path:
    lines = [f'node = "{node}"', "", "[defaults]", 'engine = "dynamo"']
    lines += [f'frontend_url = "{sim.url}"', ""]
    for worker_id, world_size in NODE_WORKERS.items():
        lines += [
            "[[workers]]",
            f'worker_id = "{worker_id}"',
            f'system_url = "{sim.system_url(worker_id)}"',
            f"world_size = {world_size}",
            "",
        ]
    path.write_text("\n".join(lines))
    return path


async def start_fleet(
    processes: Processes,
    start_sim: Callable[..., Any],
    nats_url: str,
    fleet: str,
    tmp: Path,
    *,
    metrics_port: int | None = None,
) -> tuple[SimFleet, Any]:
    sim: SimFleet = await start_sim({**NODE_WORKERS, LONE: 1})
    coordinator = CoordinatorConfig(fleet=fleet, frontend_url=sim.url, expected_world_size=5)
    await processes.start_coordinator(coordinator, nats_url=nats_url)
    node = await processes.start(
        "node-gpu-a",
        [
            "agent",
            "--nats",
            nats_url,
            "--fleet",
            fleet,
            "--heartbeat-s",
            "0.2",
            "--node-file",
            str(node_file(tmp / "node.toml", sim)),
            *(["--metrics-port", str(metrics_port)] if metrics_port else []),
        ],
    )
    lone = AgentConfig(
        fleet=fleet,
        worker_id=LONE,
        system_url=sim.system_url(LONE),
        frontend_url=sim.url,
        heartbeat_s=0.2,
    )
    await processes.start_agent(lone, nats_url=nats_url)
    return sim, node


class Heard:
    """Every ack and heartbeat message of the fleet, as it came."""

    def __init__(self) -> None:
        self.acks: list[Any] = []
        self.beats: list[Any] = []

    async def follow(self, nats_url: str, client: UpdateClient) -> Any:
        nc = await nats.connect(nats_url)
        await nc.subscribe(client.subjects.ack_any(), cb=self._on_ack)
        await nc.subscribe(client.subjects.heartbeat_any(), cb=self._on_beat)
        await nc.flush()
        return nc

    async def _on_ack(self, msg: Msg) -> None:
        self.acks.append(ack_message_decoder.decode(msg.data))

    async def _on_beat(self, msg: Msg) -> None:
        self.beats.append(beat_message_decoder.decode(msg.data))


async def test_a_node_agent_and_a_lone_agent_serve_one_fleet_per_worker(
    processes: Processes,
    start_sim: Callable[..., Any],
    nats_url: str,
    fleet_name: str,
    client: UpdateClient,
    tmp_path: Path,
    make_adapter: Callable[[int], str],
) -> None:
    heard = Heard()
    listener = await heard.follow(nats_url, client)
    port = free_port()
    try:
        sim, _node = await start_fleet(
            processes, start_sim, nats_url, fleet_name, tmp_path, metrics_port=port
        )
        await wait_live_workers(client, [*NODE_WORKERS, LONE], processes=processes)

        result = await client.update("policy", make_adapter(1), version=1)
        async with httpx.AsyncClient(timeout=10) as http:
            metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text

        assert result.committed, result
        sizes = {entry.worker_id: entry.world_size for entry in result.rank_map.entries}
        assert sizes == {**NODE_WORKERS, LONE: 1}
        assert [e.rank_offset for e in result.rank_map.entries] == [
            1,
            2,
            4,
            5,
        ]  # the trainer is rank 0
        for worker in sim.workers.values():
            assert "policy-v1" in worker.adapters and not worker.paused
    finally:
        await listener.close()
    # The node's one metrics port tells its workers' engine calls apart.
    for worker_id in NODE_WORKERS:
        assert (
            f'lorabus_engine_call_seconds_count{{operation="load",worker="{worker_id}"}} 1.0'
            in (metrics)
        ), metrics
    node_acks = [m for m in heard.acks if isinstance(m, NodeAcks)]
    assert node_acks, "the node's acks came one by one, or not on its subject"
    assert all(m.node == "gpu-a" for m in node_acks)
    acked = {ack.worker_id for m in node_acks for ack in m.acks}
    assert acked == set(NODE_WORKERS)
    # Batched: fewer node messages than the node's workers' acks.
    assert len(node_acks) < sum(len(m.acks) for m in node_acks)
    assert any(isinstance(m, NodeBeats) and len(m.beats) > 1 for m in heard.beats)

    # The audit trail keeps the node's acks: it verifies, the tap shows each
    # worker's ack, and the timeline draws a row per worker.
    common = ["--nats", nats_url, "--fleet", fleet_name]
    verified = await run_lorabus("audit", "verify", "--live", *common)
    tapped = await run_lorabus("tap", *common, "--no-follow")
    page = tmp_path / "timeline.html"
    drawn = await run_lorabus("audit", "timeline", "--live", *common, "--out", str(page))
    assert verified.returncode == 0 and "0 violation(s)" in verified.stdout, verified
    for worker_id in NODE_WORKERS:
        assert f"gpu-a/{worker_id}" in tapped.stdout, tapped.stdout
    assert drawn.returncode == 0, drawn
    html = page.read_text()
    assert all(worker_id in html for worker_id in [*NODE_WORKERS, LONE])


async def test_one_failing_engine_fails_its_worker_alone_and_a_killed_node_leaves_whole(
    processes: Processes,
    start_sim: Callable[..., Any],
    nats_url: str,
    fleet_name: str,
    client: UpdateClient,
    tmp_path: Path,
    make_adapter: Callable[[int], str],
) -> None:
    sim, node = await start_fleet(processes, start_sim, nats_url, fleet_name, tmp_path)
    await wait_live_workers(client, [*NODE_WORKERS, LONE], processes=processes)
    sim.workers["w001"].set_faults(fail_next_loads=100, load_failure_status=400)

    failed = await client.update("policy", make_adapter(1), version=1)

    assert not failed.committed
    bad = {worker_id for worker_id, o in failed.workers.items() if not o.ok}
    assert bad == {"w001"}, failed.workers
    for worker_id in ("w000", "w002", LONE):
        assert not sim.workers[worker_id].paused

    await node.kill()
    # Its three workers leave together; the lone agent stays.
    await wait_live_workers(client, [LONE], deadline_s=DEADLINE_S)
    for worker in sim.workers.values():
        assert not worker.paused
