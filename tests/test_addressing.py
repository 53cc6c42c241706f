"""Who acts on a command: a term's first pause names each member on its own
subject, later ones are one broadcast to the agents a pause of that term named
(less those excluded), later commands address the agents that took that pause
(less those excluded), and no message names more than one member."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from hand_coordinator import EPOCH, HandCoordinator
from nats.aio.msg import Msg

from lorabus.bus.connect import close, connect
from lorabus.schemas import (
    Command,
    CommittedNotice,
    LoadCommand,
    PauseCommand,
    ResumeCommand,
    Subjects,
    command_decoder,
    is_addressed_to,
)
from lorabus.testbed.stack import EmbeddedStack


def _pause(update_id: str, targets: list[str]) -> PauseCommand:
    return PauseCommand(update_id=update_id, targets=targets, budget_s=5, epoch=EPOCH)


def _cohort_resume(update_id: str, excluded: list[str] | None = None) -> ResumeCommand:
    return ResumeCommand(
        update_id=update_id, cohort=True, excluded=excluded or [], budget_s=5, epoch=EPOCH
    )


def test_addressing_rules() -> None:
    pause = _pause("u1", ["w000"])
    resume = _cohort_resume("u1", excluded=["w001"])
    notice = CommittedNotice(
        update_id="u1", budget_s=0, epoch=EPOCH, served_name="p-v1", path="/a", version=1
    )

    assert is_addressed_to(pause, "w000", set()) and not is_addressed_to(pause, "w001", set())
    fleet_pause = PauseCommand(
        update_id="u1", cohort=True, excluded=["w002"], budget_s=5, epoch=EPOCH
    )
    assert is_addressed_to(fleet_pause, "w000", set()), "a cohort pause opens the cohort"
    assert not is_addressed_to(fleet_pause, "w002", set()), "excluded"
    assert is_addressed_to(resume, "w000", {(EPOCH, "u1")})
    assert not is_addressed_to(resume, "w000", {(EPOCH, "u0")}), "not in the cohort of u1"
    assert not is_addressed_to(resume, "w000", {(EPOCH - 1, "u1")}), "an older run of u1"
    assert not is_addressed_to(resume, "w001", {(EPOCH, "u1")}), "excluded"
    assert is_addressed_to(notice, "w007", set()), "a committed notice reaches everyone"


async def test_only_agents_that_took_the_pause_act_on_its_cohort_commands(
    hand: HandCoordinator,
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 1]):
        # Nobody paused for "stray": its cohort resume must be ignored by both.
        # Commands run in arrival order, so the next ack shows what ran first.
        await hand.send(_cohort_resume("stray"))
        await hand.send(_pause("marker", ["w000", "w001"]))
        first = [await hand.next_ack() for _ in range(2)]
        assert {(a.update_id, a.phase, a.worker_id) for a in first} == {
            ("marker", "pause", "w000"),
            ("marker", "pause", "w001"),
        }, first

        await hand.send(_pause("u1", ["w000", "w001"]))
        paused = {(await hand.next_ack()).worker_id for _ in range(2)}
        assert paused == {"w000", "w001"}

        await hand.send(_cohort_resume("u1", excluded=["w001"]))
        resumed = await hand.next_ack()
        assert (resumed.update_id, resumed.phase, resumed.worker_id) == ("u1", "resume", "w000")
        assert resumed.ok and not resumed.paused

        # w001 was excluded: its next ack is for the command after the resume.
        await hand.send(_pause("marker-2", ["w001"]))
        after = await hand.next_ack()
        assert (after.update_id, after.worker_id) == ("marker-2", "w001"), after


async def test_no_message_names_more_than_one_member(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    subjects = Subjects(fleet=fleet_name)
    broadcasts: list[Command] = []
    to_one: dict[str, list[Command]] = {}
    noticed = asyncio.Event()

    async def on_broadcast(msg: Msg) -> None:
        command = command_decoder.decode(msg.data)
        broadcasts.append(command)
        if isinstance(command, CommittedNotice) and command.version == 2:
            noticed.set()

    async def on_own_subject(msg: Msg) -> None:
        to_one.setdefault(msg.subject.rsplit(".", 1)[-1], []).append(
            command_decoder.decode(msg.data)
        )

    async with make_stack([2, 1, 1, 4], heartbeat_s=0.2) as stack:
        assert stack.client is not None
        nc = await connect(nats_url, name="test-listener")
        try:
            await nc.subscribe(subjects.cmd(), cb=on_broadcast)
            await nc.subscribe(subjects.cmd_worker("*"), cb=on_own_subject)
            await nc.flush()
            first = await stack.client.update("policy", make_adapter(1), version=1)
            second = await stack.client.update("policy", make_adapter(2), version=2)
            await asyncio.wait_for(noticed.wait(), 10)
        finally:
            await close(nc)

    assert first.committed and second.committed, (first.error, second.error)
    members = ["w000", "w001", "w002", "w003"]
    assert sorted(first.workers) == members
    for worker_id, commands in to_one.items():
        assert all(c.targets == [worker_id] and not c.cohort for c in commands), commands
    # The term's first pause names each member on its own subject; the second
    # is one broadcast, naming nobody.
    assert sorted(to_one) == members
    for worker_id in members:
        pauses = [c.update_id for c in to_one[worker_id] if isinstance(c, PauseCommand)]
        assert first.update_id in pauses, pauses
    by_update = {(type(c), c.update_id): c for c in broadcasts}
    assert (PauseCommand, first.update_id) not in by_update
    pause = by_update[(PauseCommand, second.update_id)]
    assert pause.cohort and pause.targets == [] and pause.excluded == [], pause
    # Each pause carries the load: no load goes out on its own, by name or not.
    assert not any(isinstance(c, LoadCommand) for c in broadcasts)
    assert not any(isinstance(c, LoadCommand) for cs in to_one.values() for c in cs)
    assert pause.then_load is not None and pause.then_load.served_name == "policy-v2"
    for update in (first, second):
        command = by_update[(ResumeCommand, update.update_id)]
        assert command.cohort and command.targets == [] and command.excluded == [], command
    notice = by_update[(CommittedNotice, second.update_id)]
    assert notice.targets == [] and notice.served_name == "policy-v2"
