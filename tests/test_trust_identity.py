"""Who sent a heartbeat or an ack is read from its subject, never from its body;
what a heartbeat claims is bounded; one worker id has one live agent."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from events import EventListener
from nats.aio.msg import Msg
from processes import Processes

from lorabus.agents import AgentConfig
from lorabus.audit.render import status_text
from lorabus.bus.connect import close, connect
from lorabus.schemas import (
    Ack,
    BadMessage,
    Heartbeat,
    LoadCommand,
    PauseCommand,
    Phase,
    Subjects,
    WorkerConflict,
    command_decoder,
    encode,
)
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 15.0


async def test_an_ok_ack_claiming_another_worker_does_not_count(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    subjects = Subjects(fleet=fleet_name)
    async with make_stack([1, 1]) as stack:
        assert stack.client is not None and stack.sim is not None
        # w001's real load fails, slowly: a forged "ok" would arrive first.
        stack.sim.workers["w001"].set_faults(fail_next_loads=100, latency_s={"load": 1.0})
        forger = await connect(nats_url, name="test-forger")
        listener = EventListener(forger, subjects)
        await listener.start()

        async def forge_ack(msg: Msg) -> None:
            command = command_decoder.decode(msg.data)
            # The load goes out inside the pause (on each member's own subject in
            # a term's first update), and on its own only as a re-send.
            if isinstance(command, PauseCommand) and command.then_load is not None:
                served_name = command.then_load.served_name
            elif isinstance(command, LoadCommand):
                served_name = command.served_name
            else:
                return
            forged = Ack(
                update_id=command.update_id,
                phase=Phase.LOAD,
                worker_id="w001",
                ok=True,
                world_size=1,
                adapters=[served_name],
                paused=True,
                epoch=command.epoch,
            )
            await forger.publish(subjects.ack("x"), encode(forged))

        try:
            await forger.subscribe(subjects.cmd(), cb=forge_ack)
            await forger.subscribe(subjects.cmd_worker("*"), cb=forge_ack)
            await forger.flush()
            result = await stack.client.update("policy", make_adapter(1), version=1)
            reports = await listener.wait_for(BadMessage)
        finally:
            await close(forger)

    assert not result.committed, "w001's load failed: the forged ack must not stand for it"
    assert not result.workers["w001"].ok
    report = reports[0]
    assert isinstance(report, BadMessage)
    assert report.subject == subjects.ack("x")
    assert "'x'" in report.error and "'w001'" in report.error


async def test_heartbeats_that_lie_do_not_enter_the_membership(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    subjects = Subjects(fleet=fleet_name)

    def beat(worker_id: str, **changes: object) -> bytes:
        heartbeat = Heartbeat(
            worker_id=worker_id,
            world_size=4,
            engine="dynamo",
            adapters=[],
            paused=False,
            interval_s=0.2,
        )
        return encode(msgspec.structs.replace(heartbeat, **changes))

    lies = {
        "another worker id": (subjects.heartbeat("w000"), beat("w009")),
        "a beat that never expires": (subjects.heartbeat("w009"), beat("w009", interval_s=1e300)),
        "a beat beyond the coordinator's range": (
            subjects.heartbeat("w009"),
            beat("w009", interval_s=3600.0),
        ),
        "world size 0": (subjects.heartbeat("w009"), beat("w009", world_size=0)),
        "a worker id with a space": (subjects.heartbeat("w009"), beat("w 9")),
    }
    async with make_stack([1, 2]) as stack:
        assert stack.client is not None
        liar = await connect(nats_url, name="test-liar")
        listener = EventListener(liar, subjects)
        await listener.start()
        try:
            for _ in range(5):  # beats, not one message: each must be refused each time
                for subject, payload in lies.values():
                    await liar.publish(subject, payload)
                await liar.flush()
                await asyncio.sleep(0.2)
            reports = await listener.wait_for(BadMessage, count=len(lies))
            status = await stack.client.status()
            result = await stack.client.update("policy", make_adapter(1), version=1)
        finally:
            await close(liar)

    assert {m.worker_id for m in status.members} == {"w000", "w001"}
    assert status.live_world_size == 3
    assert result.committed, result.error
    assert result.rank_map is not None
    assert [e.worker_id for e in result.rank_map.entries] == ["w000", "w001"]
    errors = [r.error for r in reports if isinstance(r, BadMessage)]
    assert any("'w000'" in e and "'w009'" in e for e in errors), errors
    assert any("interval_s" in e for e in errors), errors
    assert any("outside the coordinator's range" in e for e in errors), errors
    assert any("world_size" in e for e in errors), errors
    assert any("worker_id" in e for e in errors), errors


async def test_a_second_agent_with_a_held_worker_id_is_refused_and_exits(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    processes: Processes,
) -> None:
    subjects = Subjects(fleet=fleet_name)
    async with make_stack([1]) as stack:
        assert stack.client is not None and stack.sim is not None
        nc = await connect(nats_url, name="test-listener")
        listener = EventListener(nc, subjects)
        await listener.start()
        try:
            impostor = await processes.start_agent(
                AgentConfig(
                    fleet=fleet_name,
                    worker_id="w000",
                    system_url=stack.sim.system_url("w000"),
                    world_size=2,
                    heartbeat_s=0.2,
                ),
                nats_url=nats_url,
            )
            async with asyncio.timeout(DEADLINE_S):
                code = await impostor.process.wait()
            conflicts = await listener.wait_for(WorkerConflict)
            status = await stack.client.status()
            text = status_text(status)
            result = await stack.client.update("policy", make_adapter(1), version=1)
        finally:
            await close(nc)

    assert code == 1
    assert "held by another live agent" in impostor.describe()
    # Started without --coordinator-key or --trust-file: it says it checks no signatures.
    assert "checks no command signatures" in impostor.describe()
    conflict = conflicts[0]
    assert isinstance(conflict, WorkerConflict)
    assert conflict.worker_id == "w000" and conflict.world_sizes == [1, 2]
    assert [(m.worker_id, m.world_size) for m in status.members] == [("w000", 1)]
    assert [(c.worker_id, c.refused) for c in status.conflicts] == [("w000", conflict.refused)]
    assert (
        f"CONFLICT: worker id w000 is claimed by a second agent (instance {conflict.refused}"
        in text
    )
    assert result.committed, result.error
    assert result.rank_map is not None
    assert [(e.worker_id, e.world_size) for e in result.rank_map.entries] == [("w000", 1)]
