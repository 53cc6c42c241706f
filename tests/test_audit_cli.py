"""The observability commands as an operator runs them: tap, audit verify,
metrics ports and the live status view."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from processes import LORABUS, Processes, child_env, run_lorabus

from lorabus.agents import AgentConfig
from lorabus.audit.verify import TrailRecord
from lorabus.coordinator import CoordinatorConfig
from lorabus.schemas import Phase, to_builtins
from lorabus.simfleet import SimFleet
from lorabus.testbed.natsserver import free_port
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 20.0


@pytest.fixture
async def stack_with_updates(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> AsyncIterator[EmbeddedStack]:
    async with make_stack([2, 1]) as stack:
        assert stack.client is not None
        for step in (1, 2):
            assert (await stack.client.update("policy", make_adapter(step), version=step)).committed
        yield stack


async def test_tap_writes_a_trail_that_audit_verify_passes(
    stack_with_updates: EmbeddedStack, nats_url: str, fleet_name: str, tmp_path: Path
) -> None:
    trail = tmp_path / "trail.jsonl"
    common = ["--nats", nats_url, "--fleet", fleet_name]
    tapped = await run_lorabus("tap", *common, "--no-follow", "--out", str(trail))
    again = await run_lorabus("tap", *common, "--no-follow", "--out", str(trail))
    verified = await run_lorabus("audit", "verify", str(trail))
    live = await run_lorabus("audit", "verify", "--live", *common)
    timeline = await run_lorabus("tap", *common, "--no-follow")

    assert tapped.returncode == 0, tapped
    lines = trail.read_text().splitlines()
    seqs = [json.loads(line)["seq"] for line in lines]
    assert seqs == sorted(set(seqs)), "a second run appends nothing twice"
    assert again.returncode == 0, again
    assert verified.returncode == 0 and "0 violation(s)" in verified.stdout, verified
    assert live.returncode == 0 and "0 violation(s)" in live.stdout, live
    assert "-- update" in timeline.stdout and "update_finished" in timeline.stdout, timeline


async def test_a_following_tap_started_before_the_fleet_waits_for_its_stream(
    nats_url: str,
    fleet_name: str,
    tmp_path: Path,
    processes: Processes,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    """Started beside a fleet (compose starts everything at once), a tap may come
    up before the coordinator has created the audit stream: it waits for it. A
    replay of a fleet without one says so at once."""
    common = ["--nats", nats_url, "--fleet", fleet_name]
    trail = tmp_path / "trail.jsonl"
    replay = await run_lorabus("tap", *common, "--no-follow")
    tap = await processes.start("tap", ["tap", *common, "--follow", "--out", str(trail)])
    async with asyncio.timeout(DEADLINE_S):
        while "waiting for it" not in tap.log_tail(50):
            processes.check_alive()
            await asyncio.sleep(0.1)
    async with make_stack([1]) as stack:
        assert stack.client is not None
        result = await stack.client.update("policy", make_adapter(1), version=1)
        async with asyncio.timeout(DEADLINE_S):
            while "update_finished" not in (trail.read_text() if trail.exists() else ""):  # noqa: ASYNC110
                await asyncio.sleep(0.1)
    tap.ended_on_purpose = True
    tap.request_stop()

    assert replay.returncode == 1, replay
    assert "has no audit stream" in replay.stderr, replay
    assert result.committed, result.error
    assert result.update_id in trail.read_text()


async def test_audit_verify_exits_1_and_names_a_planted_violation(tmp_path: Path) -> None:
    from lorabus.schemas import Ack

    pause = Ack(
        update_id="u1",
        phase=Phase.PAUSE,
        worker_id="w9",
        ok=True,
        world_size=1,
        adapters=[],
        paused=True,
        epoch=1,
    )
    record = TrailRecord(
        seq=7, subject="lorabus.f.ack.w9", ts=1.0, kind="ack", message=to_builtins(pause)
    )
    trail = tmp_path / "bad.jsonl"
    trail.write_text(json.dumps(to_builtins(record)) + "\n")
    verified = await run_lorabus("audit", "verify", str(trail))

    assert verified.returncode == 1, verified
    assert "unresumed_pause" in verified.stdout and "[7]" in verified.stdout, verified


async def _scrape(port: int, expected: str) -> str:
    """Poll the metrics page until it shows ``expected`` (the service is still starting)."""
    async with httpx.AsyncClient(timeout=2) as http:
        while True:
            try:
                response = await http.get(f"http://127.0.0.1:{port}/metrics")
                if response.status_code == 200 and expected in response.text:
                    return response.text
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)


async def test_coordinator_and_agent_serve_metrics_on_their_ports(
    nats_url: str, fleet_name: str, tmp_path: Path
) -> None:
    coordinator_port, agent_port = free_port(), free_port()
    async with SimFleet(["w000"], [1]) as sim, Processes(tmp_path / "logs") as processes:
        await processes.start_coordinator(
            CoordinatorConfig(fleet=fleet_name, frontend_url=sim.url, expected_world_size=1),
            nats_url=nats_url,
            extra=["--metrics-port", str(coordinator_port)],
        )
        await processes.start_agent(
            AgentConfig(
                fleet=fleet_name,
                worker_id="w000",
                system_url=sim.system_url("w000"),
                heartbeat_s=0.2,
            ),
            nats_url=nats_url,
            extra=["--metrics-port", str(agent_port)],
        )
        coordinator_text = await asyncio.wait_for(
            _scrape(coordinator_port, 'lorabus_heartbeat_age_seconds{worker="w000"}'), DEADLINE_S
        )
        resumes = 'lorabus_engine_call_seconds_count{operation="resume",worker="w000"}'
        agent_text = await asyncio.wait_for(_scrape(agent_port, resumes), DEADLINE_S)

    assert "lorabus_engines_paused" in coordinator_text
    assert "lorabus_update_duration_seconds" in coordinator_text
    assert resumes in agent_text


async def test_status_watch_redraws_until_interrupted(
    stack_with_updates: EmbeddedStack, nats_url: str, fleet_name: str
) -> None:
    process = await asyncio.create_subprocess_exec(
        str(LORABUS),
        "status",
        "--nats",
        nats_url,
        "--fleet",
        fleet_name,
        "--watch",
        "--interval",
        "0.2",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=child_env({"PYTHONUNBUFFERED": "1"}),
    )
    try:
        assert process.stdout is not None
        seen = b""
        while seen.count(b"leader ") < 2:
            chunk = await asyncio.wait_for(process.stdout.read(4096), DEADLINE_S)
            assert chunk, "status --watch ended by itself"
            seen += chunk
        process.send_signal(signal.SIGINT)
        await asyncio.wait_for(process.wait(), DEADLINE_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()

    text = seen.decode()
    assert "policy-v2 (version 2)" in text and "w000" in text and "ready" in text
