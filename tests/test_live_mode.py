"""Live mode: the new versioned name is loaded and verified on every member
while every engine keeps serving the previous one; nothing pauses, and what
does not commit is unloaded where it loaded. Real NATS, real HTTP engines."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
from processes import Processes, run_lorabus, wait_live_workers

from lorabus.client import UpdateClient
from lorabus.schemas import ErrorCode, Naming, UpdateMode
from lorabus.simfleet import SimFleet
from lorabus.testbed.stack import EmbeddedStack

PAUSE = ("POST", "/engine/pause_generation")
WORLD_SIZES = {"w000": 2, "w001": 1}


def _pauses(stack: EmbeddedStack) -> int:
    assert stack.sim is not None
    return sum(w.count_requests(*PAUSE) for w in stack.sim.workers.values())


async def _rollout(url: str, model: str) -> int:
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(
            f"{url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        )
        return response.status_code


async def test_a_live_update_commits_beside_the_served_version_without_a_pause(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([2, 1], mode=UpdateMode.LIVE, keep=2) as stack:
        assert stack.client is not None and stack.sim is not None
        first = await stack.client.update("policy", make_adapter(1), version=1)
        slow = stack.sim.workers["w001"]
        slow.set_faults(latency_s={"load": 2.0})
        second = asyncio.create_task(stack.client.update("policy", make_adapter(2), version=2))
        await asyncio.wait_for(slow.wait_until(lambda: slow.loads_received >= 2), 15)
        # The load of v2 is under way: v1 is served all along, nothing is paused.
        served_meanwhile = await _rollout(stack.sim.url, "policy-v1")
        paused_meanwhile = [w.worker_id for w in stack.sim.workers.values() if w.paused]
        second_result = await asyncio.wait_for(second, 30)
        third = await stack.client.update("policy", make_adapter(3), version=3)
        async with asyncio.timeout(15):  # the agents retire beyond --keep after answering
            while any("policy-v1" in w.adapters for w in stack.sim.workers.values()):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        adapters = {w.worker_id: sorted(w.adapters) for w in stack.sim.workers.values()}
        pauses = _pauses(stack)
        audit = await run_lorabus("audit", "verify", "--live", "--nats", nats_url,
                                  "--fleet", fleet_name)  # fmt: skip

    assert first.committed and second_result.committed and third.committed
    assert audit.returncode == 0 and "0 violation(s)" in audit.stdout, audit
    assert served_meanwhile == 200 and paused_meanwhile == []
    assert pauses == 0, "a live update paused an engine"
    assert "pause" not in second_result.phases and "resume" not in second_result.phases
    assert set(second_result.phases) >= {"quorum", "load", "verify"}
    assert second_result.adapter == "policy-v2" and second_result.rank_map is not None
    assert adapters == {w: ["policy-v2", "policy-v3"] for w in ("w000", "w001")}


async def test_a_failed_live_update_leaves_the_served_version_and_withdraws_the_new(
    make_adapter: Callable[[int], str], make_stack: Callable[..., EmbeddedStack]
) -> None:
    async with make_stack([1, 1]) as stack:  # pause mode by default: live per request
        assert stack.client is not None and stack.sim is not None
        first = await stack.client.update("policy", make_adapter(1), version=1)
        pauses_before = _pauses(stack)
        stack.sim.workers["w001"].set_faults(fail_next_loads=1, load_failure_status=400)
        failed = await stack.client.update(
            "policy", make_adapter(2), version=2, mode=UpdateMode.LIVE
        )
        adapters = {w.worker_id: sorted(w.adapters) for w in stack.sim.workers.values()}
        served = await _rollout(stack.sim.url, "policy-v1")
        pauses_after = _pauses(stack)

    assert first.committed
    assert failed.error is not None and failed.error.code == ErrorCode.WORKER_FAILED, failed
    assert adapters == {"w000": ["policy-v1"], "w001": ["policy-v1"]}
    assert served == 200
    assert pauses_after == pauses_before


async def test_live_mode_needs_versioned_names_and_the_cli_asks_for_it(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1], naming=Naming.FIXED) as stack:
        assert stack.client is not None
        refused = await stack.client.update("policy", make_adapter(1), mode="live")
    async with make_stack([1]) as stack:
        assert stack.sim is not None
        shown = await run_lorabus(
            "update", "--nats", nats_url, "--fleet", fleet_name, "--adapter", "policy",
            "--path", make_adapter(2), "--mode", "live", "--json",
        )  # fmt: skip
        pauses = _pauses(stack)

    assert refused.error is not None and refused.error.code == ErrorCode.BAD_REQUEST
    assert "versioned naming" in refused.error.message
    assert shown.returncode == 0 and '"status": "committed"' in shown.stdout, shown
    assert pauses == 0


async def test_a_standby_withdraws_the_live_update_of_a_killed_leader(
    processes: Processes,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    start_sim: Callable[..., Awaitable[SimFleet]],
) -> None:
    """Failover as in pause mode: the leader dies while every member loads; the
    standby takes over, unloads the version that never committed, and answers
    the retried id ``failover``; nothing was paused at any time."""
    sim = await start_sim(WORLD_SIZES)
    coordinators = await processes.start_failover_fleet(
        sim, WORLD_SIZES, fleet=fleet_name, nats_url=nats_url, leader_lease_s=2.0,
        mode=UpdateMode.LIVE,
    )  # fmt: skip
    async with await UpdateClient.connect(nats_url, fleet_name) as client:
        before = await wait_live_workers(client, WORLD_SIZES, processes=processes)
        for worker in sim.workers.values():
            worker.set_faults(latency_s={"load": 3.0})
        path = make_adapter(1)
        first_try = asyncio.create_task(
            client.update("policy", path, version=1, update_id="step-1", timeout_s=2)
        )
        await asyncio.wait_for(
            asyncio.gather(
                *(w.wait_until(lambda w=w: w.loads_received >= 1) for w in sim.workers.values())
            ),
            30,
        )
        await coordinators[before.leader].kill()
        await first_try
        retried = await client.update("policy", path, version=1, update_id="step-1", timeout_s=60)

    assert retried.error is not None and retried.error.code == ErrorCode.FAILOVER, retried
    for worker in sim.workers.values():
        assert worker.count_requests(*PAUSE) == 0, worker.worker_id
        assert not worker.paused, worker.worker_id
        assert "policy-v1" not in worker.adapters, worker.worker_id
