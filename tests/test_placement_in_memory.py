"""Placement end to end: updates that ask for some workers only, with the real
coordinator and agents on the in-memory bus (coordinator/placement.py).

What must hold: only the chosen workers load the adapter; the result's rank
map, the commit point and the status name them; the next version lands where
the last one is served; workers dropped from the placement unload it; an
agent that starts later loads only what is placed on it; a worker that leaves
is replaced; pause mode and placements no live workers can meet fail clearly."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from memory_fleet import HEARTBEAT_S, InMemoryFleet

from lorabus.coordinator.placed_members import HEARD_EVERYONE_AFTER_S
from lorabus.schemas import PLACED_SINCE, ErrorCode, Heartbeat, UpdateMode, encode
from lorabus.schemas.bounds import MAX_LABELS

pytestmark = pytest.mark.looptime

ZONES = {"w0": "a", "w1": "a", "w2": "b", "w3": "b"}


def _fleet(**settings: object) -> InMemoryFleet:
    settings.setdefault("mode", UpdateMode.LIVE)
    return InMemoryFleet(
        {"w0": 1, "w1": 2, "w2": 1, "w3": 1},
        labels={w: {"zone": zone} for w, zone in ZONES.items()},
        **settings,
    )


def _holding(fleet: InMemoryFleet, name: str) -> list[str]:
    return sorted(w for w, engine in fleet.engines.items() if name in engine.adapters)


async def _until(check: Callable[[], bool]) -> None:
    """Until ``check()`` holds: agents act on a notice after the answer."""
    async with asyncio.timeout(30):
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_an_adapter_placed_on_some_workers_is_served_there_only() -> None:
    async with _fleet() as fleet:
        client = fleet.client()
        first = await client.update("p", "/adapters/p/1", version=1, replicas=2)
        assert first.committed, first
        placed = sorted(first.workers)
        assert len(placed) == 2, first.workers
        assert sorted(e.worker_id for e in first.rank_map.entries) == placed  # type: ignore[union-attr]
        assert first.rank_map.world_size == 1 + sum(  # type: ignore[union-attr]
            fleet.world_sizes[w] for w in placed
        )
        assert _holding(fleet, "p-v1") == placed
        assert fleet.coordinator.book.committed["p"].workers == placed  # the commit point
        status = await client.status()
        (adapter,) = status.adapters
        assert adapter.placed == placed and sorted(adapter.holders) == placed
        assert {m.worker_id: m.labels for m in status.members}["w2"] == {"zone": "b"}

        # The next version lands where the last one is served.
        second = await client.update("p", "/adapters/p/2", version=2, replicas=2)
        assert second.committed and sorted(second.workers) == placed, second
        assert _holding(fleet, "p-v2") == placed

        # An adapter without placement is still everywhere.
        everywhere = await client.update("q", "/adapters/q/1", version=1)
        assert everywhere.committed and _holding(fleet, "q-v1") == sorted(ZONES)


async def test_a_selector_places_by_labels_and_a_worker_dropped_unloads() -> None:
    async with _fleet(keep=2) as fleet:
        client = fleet.client()
        zone_b = await client.update("p", "/adapters/p/1", version=1, selector={"zone": "b"})
        assert zone_b.committed and sorted(zone_b.workers) == ["w2", "w3"], zone_b
        assert _holding(fleet, "p-v1") == ["w2", "w3"]

        # One replica of zone b: the other worker unloads every version it held.
        one = await client.update(
            "p", "/adapters/p/2", version=2, replicas=1, selector={"zone": "b"}
        )
        assert one.committed and len(one.workers) == 1, one
        (kept_on,) = one.workers
        dropped = ({"w2", "w3"} - {kept_on}).pop()
        await _until(lambda: not fleet.engines[dropped].adapters)
        assert fleet.engines[kept_on].adapters == ["p-v1", "p-v2"]  # keep=2: both versions
        assert _holding(fleet, "p-v1") == [kept_on]


async def test_an_agent_started_later_loads_only_what_is_placed_on_it() -> None:
    async with _fleet() as fleet:
        client = fleet.client()
        placed = await client.update("p", "/adapters/p/1", version=1, replicas=1)
        assert placed.committed, placed
        (on,) = placed.workers
        everywhere = await client.update("q", "/adapters/q/1", version=1)
        assert everywhere.committed
        others = sorted(set(ZONES) - {on})
        for worker in (on, others[0]):
            await fleet.kill_agent(worker)
            fleet.engines[worker].adapters.clear()  # its engine restarted empty
            await fleet.start_agent(worker, fleet.world_sizes[worker])
        await _until(lambda: fleet.engines[on].adapters == ["p-v1", "q-v1"])
        assert fleet.engines[others[0]].adapters == ["q-v1"]


async def test_placements_that_cannot_be_met_fail_clearly() -> None:
    async with _fleet(quorum_timeout_s=2.0) as fleet:
        client = fleet.client()
        # Just started, the coordinator may not have heard every agent yet: it waits.
        early = await client.update("p", "/adapters/p/1", version=1, replicas=5)
        assert early.error is not None and early.error.code == ErrorCode.QUORUM_TIMEOUT
        assert "5 worker(s)" in early.error.message and "4 live" in early.error.message
        # Once it has heard them all, what no worker can meet fails at once.
        await asyncio.sleep(HEARD_EVERYONE_AFTER_S)
        started = asyncio.get_running_loop().time()
        too_many = await client.update("p", "/adapters/p/1", version=1, replicas=5)
        assert too_many.error is not None and too_many.error.code == ErrorCode.BAD_REQUEST
        assert "the fleet has 4 such worker(s)" in too_many.error.message
        nowhere = await client.update("p", "/adapters/p/1", version=1, selector={"zone": "c"})
        assert nowhere.error is not None and nowhere.error.code == ErrorCode.BAD_REQUEST
        assert "zone=c" in nowhere.error.message
        assert asyncio.get_running_loop().time() - started < fleet.config.quorum_timeout_s
        paused = await client.update("p", "/adapters/p/1", version=1, replicas=1, mode="pause")
        assert paused.error is not None and paused.error.code == ErrorCode.BAD_REQUEST
        assert "live mode" in paused.error.message
        assert all(not engine.adapters for engine in fleet.engines.values())
        # A selector past the wire's bound is refused as it decodes.
        labels = {f"k{i}": "v" for i in range(MAX_LABELS + 1)}
        too_wide = await client.update("p", "/adapters/p/1", version=1, selector=labels)
        assert too_wide.error is not None and too_wide.error.code == ErrorCode.BAD_REQUEST


async def test_a_placed_worker_that_leaves_is_replaced() -> None:
    """Killed for good, a placed worker's replica moves to another worker of
    the selector, which loads the adapter; a restart within the grace moves
    nothing."""
    async with _fleet() as fleet:
        client = fleet.client()
        placed = await client.update(
            "p", "/adapters/p/1", version=1, replicas=1, selector={"zone": "a"}
        )
        assert placed.committed, placed
        (first,) = placed.workers
        other = ({"w0", "w1"} - {first}).pop()

        # Back within seconds: still placed where it was.
        await fleet.kill_agent(first)
        await asyncio.sleep(fleet.config.replace_after_s / 3)
        await fleet.start_agent(first, fleet.world_sizes[first])
        await asyncio.sleep(fleet.config.replace_after_s * 2)
        assert fleet.coordinator.book.committed["p"].workers == [first]

        # Gone for good: the other zone-a worker takes its place, never zone b.
        await fleet.kill_agent(first)
        fleet.engines[first].adapters.clear()
        await _until(lambda: _holding(fleet, "p-v1") == [other])
        record = fleet.coordinator.book.committed["p"]
        assert record.workers == [other] and record.selector == {"zone": "a"}
        assert [e.worker_id for e in record.rank_map.entries] == [other]
        status = await client.status()
        assert [a.placed for a in status.adapters] == [[other]]
        # The next version lands where it is served now.
        second = await client.update(
            "p", "/adapters/p/2", version=2, replicas=1, selector={"zone": "a"}
        )
        assert second.committed and list(second.workers) == [other], second


async def test_adapters_placed_at_once_spread_within_one_of_even() -> None:
    """Placed updates that run at the same time count each other's choice:
    eight adapters of 1 replica on four workers, requested together, land two
    on each (the later of two at once would otherwise see an empty fleet)."""
    async with _fleet() as fleet:
        client = fleet.client()
        results = await asyncio.gather(
            *(client.update(f"t{k}", f"/adapters/t{k}/1", version=1, replicas=1) for k in range(8))
        )
        assert all(r.committed for r in results), results
        counts = {w: len(engine.adapters) for w, engine in fleet.engines.items()}
        assert sorted(counts.values()) == [2, 2, 2, 2], counts


async def test_a_worker_that_restarts_keeps_its_place_and_one_that_missed_a_move_unloads() -> None:
    """An update waits for a placed worker that is only restarting, rather
    than placing the next version elsewhere; a worker dropped from the
    placement while it was away unloads the adapter at its return."""
    async with _fleet(keep=1) as fleet:
        client = fleet.client()
        first = await client.update("p", "/adapters/p/1", version=1, selector={"zone": "b"})
        assert first.committed and sorted(first.workers) == ["w2", "w3"], first
        # w3 restarts while v2 is requested: v2 waits for it, and lands on both.
        await fleet.kill_agent("w3")
        await asyncio.sleep(1.0)  # no longer live (3 beats missed), not yet gone
        second = asyncio.ensure_future(
            client.update("p", "/adapters/p/2", version=2, selector={"zone": "b"})
        )
        await asyncio.sleep(3.0)
        assert not second.done()
        await fleet.start_agent("w3", fleet.world_sizes["w3"])
        assert (await second).committed and sorted((await second).workers) == ["w2", "w3"]
        assert _holding(fleet, "p-v2") == ["w2", "w3"]

        # w3 away while the adapter moves to w2 alone: back, it unloads it.
        await fleet.kill_agent("w3")
        third = await client.update(
            "p", "/adapters/p/3", version=3, replicas=1, selector={"zone": "b"}
        )
        assert third.committed and list(third.workers) == ["w2"], third
        assert "p-v2" in fleet.engines["w3"].adapters  # it heard nothing
        await fleet.start_agent("w3", fleet.world_sizes["w3"])
        await _until(lambda: not fleet.engines["w3"].adapters)
        assert _holding(fleet, "p-v3") == ["w2"]


async def test_a_replacement_goes_only_where_there_is_room() -> None:
    """The worker that left has no replacement with room: the adapter stays
    on the others, a replica short, and no engine is pushed past its capacity."""
    async with _fleet() as fleet:
        client = fleet.client()
        # w0 and w1 (zone a) hold one adapter at most.
        for worker in ("w0", "w1"):
            fleet.agents[worker].executor.max_adapters = 1
        everywhere = await client.update("q", "/adapters/q/1", version=1)
        assert everywhere.committed, everywhere
        placed = await client.update("p", "/adapters/p/1", version=1, selector={"zone": "b"})
        assert placed.committed and sorted(placed.workers) == ["w2", "w3"], placed
        record = fleet.coordinator.book.committed["p"]
        assert record.selector == {"zone": "b"}
        await fleet.kill_agent("w3")
        await asyncio.sleep(fleet.config.replace_after_s * 2)
        # No zone-b worker left to take w3's place: it stays listed.
        assert fleet.coordinator.book.committed["p"].workers == ["w2", "w3"]
        assert all(len(fleet.engines[w].adapters) <= 1 for w in ("w0", "w1"))


async def test_no_placement_while_an_agent_of_an_older_wire_version_beats() -> None:
    """A version-7 agent ignores ``workers`` and would serve a placed adapter
    everywhere: while one beats, placed updates are refused, others run."""
    async with _fleet() as fleet:
        old = Heartbeat(
            v=PLACED_SINCE - 1,
            worker_id="w9",
            world_size=1,
            engine="memory",
            adapters=[],
            paused=False,
            interval_s=HEARTBEAT_S,
        )
        conn = fleet.server.connect("old-agent")
        stop = asyncio.Event()

        async def beat() -> None:
            while not stop.is_set():
                await conn.publish(fleet.subjects.heartbeat("w9"), encode(old))
                await asyncio.sleep(HEARTBEAT_S)

        beating = asyncio.ensure_future(beat())
        try:
            await asyncio.sleep(1.0)
            client = fleet.client()
            refused = await client.update("p", "/adapters/p/1", version=1, replicas=1)
            assert refused.error is not None and refused.error.code == ErrorCode.BAD_REQUEST
            assert "w9" in refused.error.message and "wire version" in refused.error.message
            assert all(not engine.adapters for engine in fleet.engines.values())
        finally:
            stop.set()
            await beating
