"""The term's records gate: commits of different adapters write at once, a
deletion round from the adapter store goes alone (it decides from records
it reads, and a commit landing between its read and a deletion would lose
what it keeps)."""

from __future__ import annotations

import asyncio

from lorabus.coordinator.term import RecordsGate


async def _hold(
    gate: RecordsGate,
    mode: str,
    inside: asyncio.Event,
    leave: asyncio.Event,
    log: list[str],
    name: str,
) -> None:
    async with gate.writing() if mode == "write" else gate.deleting():
        log.append(f"{name} in")
        inside.set()
        await leave.wait()
        log.append(f"{name} out")


async def test_writers_share_a_deletion_waits_for_them_and_later_writers_wait_for_it() -> None:
    gate, log = RecordsGate(), []
    events = {name: (asyncio.Event(), asyncio.Event()) for name in ("w1", "w2", "d", "w3")}

    def start(name: str, mode: str) -> asyncio.Task[None]:
        inside, leave = events[name]
        return asyncio.create_task(_hold(gate, mode, inside, leave, log, name))

    tasks = [start("w1", "write"), start("w2", "write")]
    await asyncio.wait_for(asyncio.gather(events["w1"][0].wait(), events["w2"][0].wait()), 1)
    tasks.append(start("d", "delete"))
    await asyncio.sleep(0.01)
    tasks.append(start("w3", "write"))
    await asyncio.sleep(0.01)
    assert log == ["w1 in", "w2 in"], "the round waits for the writers under way"

    events["w1"][1].set()
    events["w2"][1].set()
    await asyncio.wait_for(events["d"][0].wait(), 1)
    await asyncio.sleep(0.01)
    assert "w3 in" not in log, "a writer that came after the round waits for it"

    events["d"][1].set()
    events["w3"][1].set()
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert log.index("d out") < log.index("w3 in")


async def test_a_writer_cancelled_inside_lets_a_round_go() -> None:
    gate, log = RecordsGate(), []
    inside, never = asyncio.Event(), asyncio.Event()
    writer = asyncio.create_task(_hold(gate, "write", inside, never, log, "w"))
    await asyncio.wait_for(inside.wait(), 1)
    writer.cancel()
    await asyncio.gather(writer, return_exceptions=True)

    async with asyncio.timeout(1):
        async with gate.deleting():
            pass
