"""With no coordinator up, ``lorabus status`` shows what the agents' heartbeats say.

Real agents run as processes against a simulated fleet on a real nats-server,
and no coordinator runs at all. ``lorabus status`` runs as a process too: it
says on its first line that no coordinator answered, lists every worker with
its world size (also as JSON), flags an engine left paused (a pause with no
update behind it, as a coordinator that died mid-update leaves one) and an
engine not ready, never shows a heartbeat under a worker id its subject does
not name, and with nobody heard at all says so and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from processes import Finished, Processes, run_lorabus

from lorabus.bus.connect import close, connect
from lorabus.schemas import Heartbeat, PauseCommand, Subjects, encode, heartbeat_decoder
from lorabus.simfleet import SimFleet

WORLD_SIZES = {"w000": 2, "w001": 4, "w002": 1}
#: Only deadlines, so that a broken wait fails the test instead of hanging it.
HEARD_DEADLINE_S = 20.0


class Beats:
    """The last heartbeat of each worker, as the test hears them on the bus."""

    def __init__(self) -> None:
        self.last: dict[str, Heartbeat] = {}
        self._changed = asyncio.Condition()

    async def on_heartbeat(self, msg: Msg) -> None:
        beat = heartbeat_decoder.decode(msg.data)
        async with self._changed:
            self.last[msg.subject.rsplit(".", 1)[-1]] = beat
            self._changed.notify_all()

    async def wait_for(self, condition: Callable[[dict[str, Heartbeat]], bool]) -> None:
        async with asyncio.timeout(HEARD_DEADLINE_S), self._changed:
            await self._changed.wait_for(lambda: condition(self.last))


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[NatsClient]:
    nc = await connect(nats_url, name="test-status-without-coordinator")
    try:
        yield nc
    finally:
        await close(nc)


@pytest.fixture
async def beats(bus: NatsClient, fleet_name: str) -> Beats:
    heard = Beats()
    await bus.subscribe(Subjects(fleet=fleet_name).heartbeat_any(), cb=heard.on_heartbeat)
    return heard


async def _start_agents(
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
    beats: Beats,
    world_sizes: dict[str, int],
    *,
    nats_url: str,
    fleet_name: str,
) -> SimFleet:
    sim = await start_sim(world_sizes)
    await processes.start_agents(
        world_sizes, sim.system_url, frontend_url=sim.url, fleet=fleet_name, nats_url=nats_url
    )
    await beats.wait_for(lambda last: set(world_sizes) <= set(last))
    return sim


def _status(nats_url: str, fleet_name: str, *more: str) -> Awaitable[Finished]:
    return run_lorabus("status", "--nats", nats_url, "--fleet", fleet_name, *more)


def _row(stdout: str, worker_id: str) -> list[str]:
    rows = [line.split() for line in stdout.splitlines() if line.startswith(f"{worker_id} ")]
    assert len(rows) == 1, stdout
    return rows[0]


async def test_status_lists_every_agent_from_heartbeats_and_says_no_coordinator_answered(
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
    beats: Beats,
    nats_url: str,
    fleet_name: str,
) -> None:
    await _start_agents(
        processes, start_sim, beats, WORLD_SIZES, nats_url=nats_url, fleet_name=fleet_name
    )

    finished = await _status(nats_url, fleet_name)

    assert finished.returncode == 0, finished
    first = finished.stdout.splitlines()[0]
    assert "NO COORDINATOR ANSWERED" in first and "heartbeats only" in first, finished
    for worker_id, world_size in WORLD_SIZES.items():
        assert _row(finished.stdout, worker_id)[1] == str(world_size), finished
    assert "WARNING" not in finished.stdout, finished

    as_json = await _status(nats_url, fleet_name, "--json")

    assert as_json.returncode == 0, as_json
    shown = json.loads(as_json.stdout)
    assert shown["coordinator_answered"] is False
    assert {m["worker_id"]: m["world_size"] for m in shown["members"]} == WORLD_SIZES
    assert shown["live_world_size"] == sum(WORLD_SIZES.values())
    assert all(m["rank_offset"] is None for m in shown["members"])
    processes.check_alive()


async def test_an_engine_left_paused_without_an_update_gets_a_warning(
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
    beats: Beats,
    bus: NatsClient,
    nats_url: str,
    fleet_name: str,
) -> None:
    sim = await _start_agents(
        processes, start_sim, beats, WORLD_SIZES, nats_url=nats_url, fleet_name=fleet_name
    )
    # What a coordinator that died mid-update leaves behind: an engine paused by
    # a pause command (epoch 0: no coordinator ever led), with a long lease.
    subjects = Subjects(fleet=fleet_name)
    pause = PauseCommand(update_id="stranded", targets=["w001"], budget_s=30, lease_s=120)
    await bus.publish(subjects.cmd_worker("w001"), encode(pause))
    engine = sim.workers["w001"]
    async with asyncio.timeout(HEARD_DEADLINE_S):
        assert await engine.wait_until(lambda: engine.paused)
    await beats.wait_for(lambda last: last["w001"].paused)

    finished = await _status(nats_url, fleet_name)

    assert finished.returncode == 0, finished
    assert _row(finished.stdout, "w001")[4] == "yes", finished
    warnings = [line for line in finished.stdout.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, finished
    assert "w001" in warnings[0] and "paused outside any update" in warnings[0], finished
    assert engine.paused


async def test_a_heartbeat_naming_another_worker_than_its_subject_is_not_shown(
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
    beats: Beats,
    bus: NatsClient,
    nats_url: str,
    fleet_name: str,
) -> None:
    real = {"w000": 2, "w002": 1}
    await _start_agents(processes, start_sim, beats, real, nats_url=nats_url, fleet_name=fleet_name)
    subjects = Subjects(fleet=fleet_name)
    forged = Heartbeat(
        worker_id="w001", world_size=7, engine="dynamo", adapters=[], paused=True, interval_s=0.2
    )

    async def forge() -> None:
        while True:
            await bus.publish(subjects.heartbeat("w000"), encode(forged))
            await asyncio.sleep(0.1)

    forging = asyncio.create_task(forge())
    try:
        finished = await _status(nats_url, fleet_name)
    finally:
        forging.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await forging

    assert finished.returncode == 0, finished
    assert "w001" not in finished.stdout, finished
    assert _row(finished.stdout, "w000")[1] == "2", finished
    assert "ignored" in finished.stdout, finished


@pytest.mark.parametrize(
    ("reason", "shown"),
    [
        ("", "its agent has not brought the engine to the committed state"),
        ("vLLM serves no /pause: start it with VLLM_SERVER_DEV_MODE=1", None),
    ],
    ids=["converging", "with its reason"],
)
async def test_an_engine_not_ready_gets_a_warning(
    bus: NatsClient,
    beats: Beats,
    nats_url: str,
    fleet_name: str,
    reason: str,
    shown: str | None,
) -> None:
    # An agent still bringing its engine to the committed state says so in its
    # beat, and why when it knows; this one is written by hand on that
    # worker's own subject.
    subjects = Subjects(fleet=fleet_name)
    beat = Heartbeat(
        worker_id="w003",
        world_size=2,
        engine="dynamo",
        adapters=[],
        paused=False,
        interval_s=0.2,
        ready=False,
        unready_reason=reason,
    )

    async def keep_beating() -> None:
        while True:
            await bus.publish(subjects.heartbeat("w003"), encode(beat))
            await asyncio.sleep(0.2)

    beating = asyncio.create_task(keep_beating())
    try:
        await beats.wait_for(lambda last: "w003" in last)
        finished = await _status(nats_url, fleet_name)
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating

    assert finished.returncode == 0, finished
    warnings = [line for line in finished.stdout.splitlines() if line.startswith("WARNING")]
    assert warnings == [f"WARNING: w003 is not ready ({shown or reason})"], finished


async def test_with_neither_coordinator_nor_agents_status_says_so_and_exits_1(
    nats_url: str, fleet_name: str
) -> None:
    finished = await _status(nats_url, fleet_name)

    assert finished.returncode == 1, finished
    assert "no coordinator answered" in finished.stderr, finished
    assert "no agent heartbeat was heard" in finished.stderr, finished
    assert "Traceback" not in finished.stderr

    as_json = await _status(nats_url, fleet_name, "--json")

    assert as_json.returncode == 1, as_json
    shown = json.loads(as_json.stdout)
    assert shown["coordinator_answered"] is False and shown["members"] == []
    assert shown["error"]["code"] == "no_coordinator"
