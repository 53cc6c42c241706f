"""A version that did not commit is withdrawn from members whose pause went
unanswered, by name on their own subject, and every engine resumes.

Real agents and a real coordinator on a real nats-server (``make_stack``); the
engine that never answers is a simulated worker told to hang. The same
scenarios run in memory in ``test_update_in_memory.py``, where the pause also
lands late.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from nats.aio.msg import Msg

from lorabus.bus.connect import close, connect
from lorabus.schemas import Subjects, UnloadCommand, UpdateResult, command_decoder
from lorabus.simfleet import SimWorker
from lorabus.testbed.stack import EmbeddedStack

SILENT = "w002"


@contextlib.asynccontextmanager
async def _unloads_sent_to(
    nats_url: str, subjects: Subjects, worker_id: str
) -> AsyncIterator[list[UnloadCommand]]:
    """The unload commands sent to ``worker_id`` on its own subject."""
    nc = await connect(nats_url, name="test-withdraw-tap")
    unloads: list[UnloadCommand] = []

    async def on_command(msg: Msg) -> None:
        command = command_decoder.decode(msg.data)
        if isinstance(command, UnloadCommand):
            unloads.append(command)

    try:
        await nc.subscribe(subjects.cmd_worker(worker_id), cb=on_command)
        await nc.flush(timeout=5)
        yield unloads
    finally:
        await close(nc)


def _loaded_then_unloaded(worker: SimWorker) -> bool:
    calls = [(r.method, r.path) for r in worker.requests]
    load = ("POST", "/v1/loras")
    return load in calls and ("DELETE", "/v1/loras/policy-v1") in calls[calls.index(load) :]


def _unanswered_pause(result: UpdateResult) -> str:
    outcome = result.workers[SILENT]
    assert not outcome.ok and outcome.error is not None, outcome
    return outcome.error.message


async def test_a_pause_that_fails_on_one_member_withdraws_the_load_it_carried_elsewhere(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([2, 4, 1], phase_timeout_s=2) as stack:
        assert stack.client is not None and stack.sim is not None
        stack.sim.workers[SILENT].set_faults(hang=True)
        async with _unloads_sent_to(nats_url, Subjects(fleet=fleet_name), SILENT) as unloads:
            result = await stack.client.update("policy", make_adapter(1), version=1)

        assert result.status == "failed"
        assert result.error is not None and "pause failed" in result.error.message
        message = _unanswered_pause(result)
        # The coordinator's deadline, or the agent's budget just behind it.
        assert "no pause ack within 2.0s" in message or "did not finish" in message, message
        # The loads were not waited for once the pause had failed the update.
        assert "load" not in result.phases
        for worker_id in ("w000", "w001"):
            worker = stack.sim.workers[worker_id]
            assert _loaded_then_unloaded(worker), (worker_id, worker.requests)
        # The silent member's pause carried the load: withdrawn there too, by name.
        assert unloads and unloads[-1].names == ["policy-v1"]
        assert unloads[-1].targets == [SILENT]
        assert not any("policy-v1" in w.adapters for w in stack.sim.workers.values())
        assert not any(w.paused for w in stack.sim.workers.values())


async def test_a_member_left_out_for_its_pause_is_withdrawn_from_when_the_update_fails(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    # w002's pause goes unanswered (1 of 7: the update goes on without it);
    # w001's load fails, which leaves too little of the fleet to commit.
    async with make_stack([2, 4, 1], phase_timeout_s=2, quorum=0.75) as stack:
        assert stack.client is not None and stack.sim is not None
        stack.sim.workers[SILENT].set_faults(hang=True)
        stack.sim.workers["w001"].set_faults(fail_next_loads=100)
        async with _unloads_sent_to(nats_url, Subjects(fleet=fleet_name), SILENT) as unloads:
            result = await stack.client.update("policy", make_adapter(1), version=1)

        assert result.status == "failed"
        message = _unanswered_pause(result)
        assert "no pause ack" in message or "did not finish" in message, message
        assert result.workers["w001"].error is not None
        assert "injected load failure" in result.workers["w001"].error.message
        assert _loaded_then_unloaded(stack.sim.workers["w000"])
        assert unloads and unloads[-1].names == ["policy-v1"]
        assert unloads[-1].targets == [SILENT]
        assert not any("policy-v1" in w.adapters for w in stack.sim.workers.values())
        assert not any(w.paused for w in stack.sim.workers.values())
