"""An update over mixed world sizes commits everywhere and leaves nobody paused."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import httpx

from lorabus.bus.connect import close, connect
from lorabus.schemas import (
    BadPayload,
    CommittedNotice,
    Naming,
    command_decoder,
    update_result_decoder,
)
from lorabus.testbed.stack import EmbeddedStack


async def test_update_commits_on_every_worker_with_heterogeneous_ranks(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([2, 4, 1], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.sim is not None
        result = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)

        assert result.status == "committed", result.error
        assert result.adapter == "policy-v1"
        assert result.rank_map is not None
        assert [(e.worker_id, e.world_size, e.rank_offset) for e in result.rank_map.entries] == [
            ("w000", 2, 1),
            ("w001", 4, 3),
            ("w002", 1, 7),
        ]
        assert result.rank_map.world_size == 8
        assert set(result.phases) == {"quorum", "pause", "load", "verify", "resume", "canary"}
        assert all(
            outcome.ok and "policy-v1" in outcome.adapters for outcome in result.workers.values()
        )
        for worker in stack.sim.workers.values():
            assert "policy-v1" in worker.adapters, worker.worker_id
            assert not worker.paused, worker.worker_id
        async with httpx.AsyncClient(timeout=5) as http:
            listing = (await http.get(f"{stack.sim.url}/v1/models")).json()
        assert "policy-v1" in {model["id"] for model in listing["data"]}


async def test_a_commit_is_recorded_in_full_before_its_answer_and_announced_after(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    nats_url: str,
) -> None:
    """The in-flight record goes out ahead of the first command; the commit
    is claimed on it, then the commit point (the adapter's own key) is
    stored, then the result and the
    fleet's latest record; the in-flight record is cleared once both are,
    then the answer says committed, and the notice goes last: the answer
    does not queue behind the notice's fan-out. One subscription to
    everything sees the coordinator's messages in the order it sent them."""
    watcher = await connect(nats_url, name="order-watcher")
    try:
        everything = await watcher.subscribe(">")
        await watcher.flush()
        async with make_stack([1, 1], phase_timeout_s=10) as stack:
            assert stack.client is not None
            subjects = stack.client.subjects
            state, results = f"$KV.{subjects.state_bucket()}", f"$KV.{subjects.results_bucket()}"
            result = await stack.client.update("policy", make_adapter(1), version=1)
            assert result.committed, result.error
            seen = {
                f"{state}.committed.policy": "commit point",
                f"{state}.committed": "latest",
            }
            order: list[str] = []
            async with asyncio.timeout(10):
                while "notice" not in order:
                    msg = await everything.next_msg(timeout=10)
                    if msg.subject in seen:
                        order.append(seen[msg.subject])
                    elif msg.subject.startswith(f"{results}."):
                        order.append("result")  # no other update ran
                    elif msg.subject == f"{state}.inflight.policy":
                        cleared = (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE")
                        if cleared:
                            order.append("in flight cleared")
                        else:
                            order.append("claim" if "command" in order else "in flight")
                    elif msg.subject.startswith(subjects.cmd()):
                        command = command_decoder.decode(msg.data)
                        if isinstance(command, CommittedNotice):
                            order.append("notice")
                        elif "command" not in order:
                            order.append("command")
                    elif msg.subject.startswith("_INBOX."):
                        with contextlib.suppress(BadPayload):
                            if update_result_decoder.decode(msg.data) == result:
                                order.append("answer")
        assert order[:4] == ["in flight", "command", "claim", "commit point"], order
        assert sorted(order[4:6]) == ["latest", "result"], order
        assert order[6:] == ["in flight cleared", "answer", "notice"], order
    finally:
        await close(watcher)


async def test_versions_beyond_keep_are_unloaded(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 2], phase_timeout_s=10, keep=2) as stack:
        assert stack.client is not None and stack.sim is not None
        for step in (1, 2, 3):
            result = await stack.client.update("policy", make_adapter(step), version=step)
            assert result.committed, result.error
        # Each agent retires the old version itself, after the update is answered.
        kept = ["policy-v2", "policy-v3"]
        for worker in stack.sim.workers.values():
            retired = worker.wait_until(lambda w=worker: sorted(w.adapters) == kept)
            await asyncio.wait_for(retired, 10)
            assert sorted(worker.adapters) == kept


def _engine_work(stack: EmbeddedStack) -> int:
    """Engine calls that change something: each agent GETs its engine's
    adapters on its own whenever the engine has been quiet for a beat."""
    assert stack.sim is not None
    return sum(r.method != "GET" for w in stack.sim.workers.values() for r in w.requests)


async def test_repeated_update_id_returns_the_first_result_without_engine_work(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 1], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.sim is not None
        path = make_adapter(1)
        first = await stack.client.update("policy", path, version=1, update_id="step-1")
        requests_after_first = _engine_work(stack)
        again = await stack.client.update("policy", path, version=1, update_id="step-1")

        assert first.committed and again == first
        assert _engine_work(stack) == requests_after_first


async def test_asking_again_for_the_committed_version_touches_no_engine(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 1], phase_timeout_s=10) as stack:
        assert stack.client is not None and stack.sim is not None
        path = make_adapter(4)
        first = await stack.client.update("policy", path, version=4)
        requests_after_first = _engine_work(stack)
        again = await stack.client.update("policy", path, version=4)

        assert first.committed and again.committed
        assert again.update_id != first.update_id
        assert again.rank_map == first.rank_map
        assert _engine_work(stack) == requests_after_first


async def test_fixed_naming_unloads_then_loads_inside_the_pause(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1], phase_timeout_s=10, naming=Naming.FIXED) as stack:
        assert stack.client is not None and stack.sim is not None
        assert (await stack.client.update("policy", make_adapter(1), version=1)).committed
        worker = stack.sim.workers["w000"]
        worker.requests.clear()
        result = await stack.client.update("policy", make_adapter(2), version=2)

        assert result.committed and result.adapter == "policy"
        calls = [
            (r.method, r.path)
            for r in worker.requests
            if r.path != "/v1/loras" or r.method != "GET"
        ]
        assert calls == [
            ("POST", "/engine/pause_generation"),
            ("DELETE", "/v1/loras/policy"),
            ("POST", "/v1/loras"),
            ("POST", "/engine/resume_generation"),
            # The canary through the frontend, after the resume: the agent's,
            # routed to this worker, and perhaps the coordinator's, round-robin.
            *[("POST", "/v1/completions")] * (len(calls) - 4),
        ]
        assert len(calls) in (5, 6), calls
        assert worker.adapters == {"policy": worker.adapters["policy"]}


async def test_the_status_shows_the_engines_state_from_the_acks_at_once(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    # Beats far apart: agents do not beat after a command, so what the status
    # shows right after the update can only come from the update's acks.
    async with make_stack([1, 2], heartbeat_s=30) as stack:
        assert stack.client is not None
        result = await stack.client.update("policy", make_adapter(1), version=1)
        status = await stack.client.status()

    assert result.committed, result.error
    for member in status.members:
        assert "policy-v1" in member.adapters and not member.paused, member
