"""Versions beyond ``--keep`` are retired by each agent after the update is
answered: reported per worker, never while its engine is paused, and a
failed unload is retried by the next commit instead of failing anything."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from hand_coordinator import EPOCH, HandCoordinator
from nats.aio.msg import Msg

from lorabus.bus.connect import close, connect
from lorabus.schemas import (
    CommandHandled,
    CommittedNotice,
    PauseCommand,
    Phase,
    ResumeCommand,
    Subjects,
    event_decoder,
)
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 10.0


async def test_a_failed_retire_is_reported_and_the_next_commit_retires_it_again(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    reports: asyncio.Queue[CommandHandled] = asyncio.Queue()

    async def on_event(msg: Msg) -> None:
        event = event_decoder.decode(msg.data)
        if isinstance(event, CommandHandled) and event.phase is Phase.UNLOAD:
            reports.put_nowait(event)

    async with make_stack([1, 1], keep=1) as stack:
        assert stack.client is not None and stack.sim is not None
        w000, w001 = stack.sim.workers["w000"], stack.sim.workers["w001"]
        nc = await connect(nats_url, name="test-listener")
        try:
            await nc.subscribe(Subjects(fleet=fleet_name).event_any(), cb=on_event)
            await nc.flush()
            assert (await stack.client.update("policy", make_adapter(1), version=1)).committed

            w001.set_faults(fail_next_unloads=1)
            second = await stack.client.update("policy", make_adapter(2), version=2)
            assert second.committed, second.error
            retired = {}
            for _ in range(2):
                report = await asyncio.wait_for(reports.get(), DEADLINE_S)
                retired[report.worker_id] = report

            assert retired["w000"].ok and retired["w000"].update_id == second.update_id
            assert not retired["w001"].ok and retired["w001"].error is not None
            assert "injected unload failure" in retired["w001"].error.message
            assert sorted(w000.adapters) == ["policy-v2"]
            assert sorted(w001.adapters) == ["policy-v1", "policy-v2"]

            third = await stack.client.update("policy", make_adapter(3), version=3)
            assert third.committed, third.error
            for _ in range(2):
                report = await asyncio.wait_for(reports.get(), DEADLINE_S)
                assert report.ok and report.update_id == third.update_id, report
        finally:
            await close(nc)
        assert sorted(w000.adapters) == ["policy-v3"]
        assert sorted(w001.adapters) == ["policy-v3"]


async def test_an_engine_paused_for_an_update_is_not_asked_to_unload(
    make_adapter: Callable[[int], str],
    hand: HandCoordinator,
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    # An engine may refuse to unload while paused, and retiring must never hold
    # an update up: a retire that finds the engine paused is left to the next
    # commit. (A long leader lease: deposed by the hand, the stack's
    # coordinator must not take the fleet back at a higher epoch meanwhile.)
    async with make_stack([1], leader_lease_s=120) as stack:
        assert stack.client is not None and stack.sim is not None
        engine = stack.sim.workers["w000"]
        paths = {version: make_adapter(version) for version in (1, 2)}
        for version, path in paths.items():
            result = await stack.client.update("policy", path, version=version)
            assert result.committed, result.error

        targets = ["w000"]
        await hand.send(PauseCommand(update_id="u9", targets=targets, budget_s=5, epoch=EPOCH))
        assert (await hand.next_ack("u9")).ok and engine.paused
        await hand.send(
            CommittedNotice(
                update_id="u8",
                budget_s=0,
                epoch=EPOCH,
                served_name="policy-v2",
                path=paths[2],
                version=2,
                retire=["policy-v1"],
            )
        )
        await hand.send(ResumeCommand(update_id="u9", targets=targets, budget_s=5, epoch=EPOCH))
        resumed = await hand.next_ack("u9")

    assert (resumed.phase, resumed.ok) == ("resume", True)
    assert not [r for r in engine.requests if r.method == "DELETE"]
    assert sorted(engine.adapters) == ["policy-v1", "policy-v2"]
