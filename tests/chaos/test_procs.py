"""Every child of a chaos run is reaped: a stopped one is continued, then terminated."""

from __future__ import annotations

import os
from pathlib import Path

from lorabus.testbed.chaos.procs import ProcessGroup

SIM = ["sim", "--workers", "1", "--port", "0"]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_closing_the_group_stops_a_stopped_child(tmp_path: Path) -> None:
    async with ProcessGroup(tmp_path) as group:
        child = await group.start("sim", SIM)
        child.suspend()

    assert child.process.returncode is not None
    assert child.ended_on_purpose
    assert _gone(child.pid)


async def test_a_killed_child_is_waited_for(tmp_path: Path) -> None:
    async with ProcessGroup(tmp_path) as group:
        child = await group.start("sim", SIM)
        await child.kill()

        assert child.process.returncode == -9
        assert _gone(child.pid)


async def test_each_start_gets_its_own_log(tmp_path: Path) -> None:
    async with ProcessGroup(tmp_path) as group:
        first = await group.start("sim", SIM)
        second = await group.start("sim", SIM)

    assert (first.log_path.name, second.log_path.name) == ("sim.1.log", "sim.2.log")
