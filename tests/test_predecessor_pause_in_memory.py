"""An agent killed while its engine's pause call was in flight: the engine
may carry that pause out after the successor started and resumed it. The
pause was recorded on disk before it was sent (``agents/pending_pause.py``),
so the successor treats its engine as maybe paused until the pause can no
longer land, resuming it at every beat, and says so in its heartbeats.

The real agents on the in-memory bus under looptime's fake clock, the
record in a real directory; the pause that lands late is the engine's own
state flipped, as a slow engine carrying out the dead process's request
would."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from memory_fleet import HEARTBEAT_S, InMemoryFleet

from lorabus.agents import Agent, CommandExecutor
from lorabus.agents.pending_pause import PendingPause

pytestmark = pytest.mark.looptime

LATE_S = 10.0


async def _start(fleet: InMemoryFleet, worker_id: str, record: PendingPause, n: int) -> Agent:
    """Start ``worker_id``'s agent (the ``n``-th of it) with its pauses in flight
    recorded in ``record``; return it once it reports ready."""
    agent = fleet.agents[worker_id] = Agent(
        fleet.subjects,
        CommandExecutor(
            worker_id, fleet.world_sizes[worker_id], fleet.engines[worker_id], pending_pause=record
        ),
        heartbeat_s=HEARTBEAT_S,
        late_pause_s=LATE_S,
    )
    conn = fleet.connections[worker_id] = fleet.server.connect(f"{worker_id}-{n}")
    ready = asyncio.Event()
    fleet._agent_tasks[worker_id] = fleet._start(agent.run(conn, ready))  # type: ignore[arg-type]
    await asyncio.wait_for(ready.wait(), 30)
    return agent


async def _kill_in_its_pause(fleet: InMemoryFleet, record: PendingPause) -> asyncio.Task[object]:
    """Start an update, and kill w0's agent once its engine got the pause."""
    engine = fleet.engines["w0"]
    asked = asyncio.Event()

    async def unanswered() -> None:
        asked.set()
        await asyncio.sleep(3600)

    engine.on_pause = unanswered
    update = asyncio.ensure_future(fleet.client().update("policy", "/adapters/policy/1", version=1))
    await asyncio.wait_for(asked.wait(), 30)
    await fleet.kill_agent("w0")
    engine.on_pause = None
    return update


async def test_a_pause_its_predecessor_sent_that_lands_after_the_start_is_undone(
    tmp_path: Path,
) -> None:
    record = PendingPause(str(tmp_path / ".pauses" / "memory.w0.json"), LATE_S)
    async with InMemoryFleet({"w0": 1}, mode="pause", phase_timeout_s=3.0) as fleet:
        engine = fleet.engines["w0"]
        await fleet.kill_agent("w0")
        await _start(fleet, "w0", record, 1)
        update = await _kill_in_its_pause(fleet, record)
        assert record.left_s() > 0, "the pause in flight was not recorded"

        successor = await _start(fleet, "w0", record, 2)
        assert not engine.paused  # resumed at its start
        assert successor.executor.maybe_paused, "the successor did not expect the late pause"
        await asyncio.sleep(2.0)
        engine.paused = True  # the dead process's pause lands, late
        async with asyncio.timeout(5 * HEARTBEAT_S):
            while engine.paused:  # noqa: ASYNC110
                await asyncio.sleep(HEARTBEAT_S / 4)

        # Once no pause can land (and the leases the update's own pauses
        # armed meanwhile ran out), the successor stops expecting one.
        async with asyncio.timeout(120):
            while successor.executor.maybe_paused:  # noqa: ASYNC110
                await asyncio.sleep(HEARTBEAT_S)
        resumes = engine.calls.count("resume")
        await asyncio.sleep(5 * HEARTBEAT_S)
        assert engine.calls.count("resume") == resumes, "it kept resuming after the window"
        assert not engine.paused
        result = await asyncio.wait_for(update, 60)
        assert result is not None


async def test_an_answered_pause_leaves_nothing_for_a_successor(tmp_path: Path) -> None:
    """A pause the engine answered cannot land later: the record is gone, and a
    successor resumes once, at its start, and does not expect a late pause."""
    record = PendingPause(str(tmp_path / ".pauses" / "memory.w0.json"), LATE_S)
    async with InMemoryFleet({"w0": 1}, mode="pause") as fleet:
        engine = fleet.engines["w0"]
        await fleet.kill_agent("w0")
        await _start(fleet, "w0", record, 1)
        result = await fleet.client().update("policy", "/adapters/policy/1", version=1)
        assert result.committed, result
        assert "pause" in engine.calls
        assert record.left_s() == 0.0

        await fleet.kill_agent("w0")
        engine.calls.clear()
        successor = await _start(fleet, "w0", record, 2)
        assert not successor.executor.maybe_paused
        await asyncio.sleep(5 * HEARTBEAT_S)
        assert engine.calls.count("resume") == 1, engine.calls


def test_a_record_from_a_clock_set_back_or_unreadable_is_bounded(tmp_path: Path) -> None:
    record = PendingPause(str(tmp_path / ".pauses" / "w.json"), LATE_S, max_lease_s=30.0)
    assert record.left_s() == 0.0  # none yet
    record.sent(lease_s=5.0)
    assert LATE_S < record.left_s() <= LATE_S + 5.0
    record.sent(lease_s=3600.0)  # a lease is never longer than the agent grants
    assert LATE_S + 5.0 < record.left_s() <= LATE_S + 30.0
    Path(record.path).write_text('{"until": 1e300}')
    assert record.left_s() == LATE_S + 30.0
    for garbage in ("{", '{"until": "soon"}', '{"until": NaN}', "[]"):
        Path(record.path).write_text(garbage)
        assert record.left_s() == 0.0, garbage
    record.answered()
    record.answered()  # twice: nothing to remove
    assert record.left_s() == 0.0
