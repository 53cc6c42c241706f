"""Lost commands are re-sent to stragglers, and re-sent commands run only once.

Both sides are tested against the real bus with a hand-played peer: an agent
that ignores every broadcast (as if core NATS had dropped them), and a
coordinator that sends the same command twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from hand_coordinator import write_leader
from nats.aio.msg import Msg

from lorabus.bus.connect import close, connect
from lorabus.schemas import (
    Ack,
    CommittedNotice,
    Heartbeat,
    PauseCommand,
    Phase,
    RenewLeaseCommand,
    Subjects,
    ack_decoder,
    command_decoder,
    encode,
    phase_of,
)
from lorabus.testbed.stack import EmbeddedStack


async def test_a_member_that_missed_the_broadcast_gets_the_command_on_its_own_subject(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    subjects = Subjects(fleet=fleet_name)
    async with make_stack([1], expected_world_size=2) as stack:
        assert stack.client is not None
        nc = await connect(nats_url, name="test-deaf-agent")
        heard: list[tuple[str, Phase]] = []

        async def on_command(msg: Msg) -> None:
            command = command_decoder.decode(msg.data)
            if isinstance(command, CommittedNotice | RenewLeaseCommand):
                return  # not acked
            heard.append((msg.subject, phase_of(command)))
            if msg.subject == subjects.cmd():
                return  # lost, as far as the coordinator can tell
            await nc.publish(
                subjects.ack("zz"),
                encode(
                    Ack(
                        update_id=command.update_id,
                        phase=phase_of(command),
                        worker_id="zz",
                        ok=True,
                        world_size=1,
                        adapters=["policy-v1"],
                        paused=False,
                        epoch=command.epoch,
                    )
                ),
            )

        async def beat() -> None:
            while True:
                await nc.publish(
                    subjects.heartbeat("zz"),
                    encode(
                        Heartbeat(
                            worker_id="zz",
                            world_size=1,
                            engine="hand",
                            adapters=[],
                            paused=False,
                            interval_s=0.2,
                        )
                    ),
                )
                await asyncio.sleep(0.2)

        await nc.subscribe(subjects.cmd(), cb=on_command)
        await nc.subscribe(subjects.cmd_worker("zz"), cb=on_command)
        beating = asyncio.create_task(beat())
        try:
            result = await stack.client.update("policy", make_adapter(1), version=1, timeout_s=30)
        finally:
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)
            await close(nc)

        assert result.committed, result.error
        # The pause names each member on its own subject and carries the load,
        # which this agent ignores (as a version-2 agent does): the load is sent
        # to it again by name. The resume is broadcast, lost here, and re-sent
        # to the straggler by name.
        assert heard[0] == (subjects.cmd_worker("zz"), Phase.PAUSE)
        assert (subjects.cmd(), Phase.PAUSE) not in heard
        assert (subjects.cmd(), Phase.LOAD) not in heard
        assert (subjects.cmd_worker("zz"), Phase.LOAD) in heard
        assert (subjects.cmd(), Phase.RESUME) in heard
        assert (subjects.cmd_worker("zz"), Phase.RESUME) in heard


async def test_an_agent_runs_a_repeated_command_once_and_acks_it_again(
    nats_url: str,
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    subjects = Subjects(fleet=fleet_name)
    async with make_stack([1]) as stack:
        assert stack.sim is not None
        nc = await connect(nats_url, name="test-hand-coordinator")
        acks: asyncio.Queue[Ack] = asyncio.Queue()

        async def on_ack(msg: Msg) -> None:
            acks.put_nowait(ack_decoder.decode(msg.data))

        try:
            await nc.subscribe(subjects.ack("w000"), cb=on_ack)
            # A term above the stack's own coordinator's, or the agent would refuse it.
            await write_leader(nc, subjects, 100)
            pause = PauseCommand(update_id="u-hand", targets=["w000"], budget_s=5, epoch=100)
            await nc.publish(subjects.cmd(), encode(pause))
            first = await asyncio.wait_for(acks.get(), 10)
            await nc.publish(subjects.cmd_worker("w000"), encode(pause))
            second = await asyncio.wait_for(acks.get(), 10)
        finally:
            await close(nc)

        assert first == second and first.ok and first.paused
        pauses = [
            r for r in stack.sim.workers["w000"].requests if r.path == "/engine/pause_generation"
        ]
        assert len(pauses) == 1
