"""Updates of different adapters run at once; one adapter's stay in order.

The real coordinator and agents on the in-memory bus under looptime's fake
clock. An update is held where the coordinator waits on its own (the
frontend's listing of its new name), so that another adapter's update can be
seen to run, commit or fail meanwhile. Pause-mode updates of different
adapters never pause the fleet at the same time. A successor finishes or
rolls back every update its predecessor had in flight, each on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
from memory_fleet import InMemoryFleet
from store_helpers import in_flight_of

from lorabus.coordinator.store import FleetStore
from lorabus.schemas import ErrorCode, PauseCommand, UpdateMode, UpdateResult

pytestmark = pytest.mark.looptime

WORLD_SIZES = {"w0": 1, "w1": 2}
DEADLINE_S = 60.0
OpenFleet = Callable[..., Awaitable[InMemoryFleet]]


@pytest.fixture
async def open_fleet() -> AsyncIterator[OpenFleet]:
    async with AsyncExitStack() as stack:

        async def open_(**settings: Any) -> InMemoryFleet:
            return await stack.enter_async_context(InMemoryFleet(WORLD_SIZES, **settings))

        yield open_


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(DEADLINE_S):
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


def _update(fleet: InMemoryFleet, adapter: str, version: int) -> asyncio.Task[UpdateResult]:
    return asyncio.create_task(
        fleet.client().update(
            adapter,
            f"/adapters/{adapter}/{version}",
            version=version,
            update_id=f"{adapter}-{version}",
            timeout_s=DEADLINE_S,
        )
    )


def _held(fleet: InMemoryFleet, adapter: str) -> asyncio.Event:
    """Hold ``adapter``'s verify (the frontend does not list its new name)
    until the returned event is set."""
    released = fleet.frontend.holds[f"{adapter}-v"] = asyncio.Event()
    return released


def _asked_for(fleet: InMemoryFleet, adapter: str) -> bool:
    return any(model.startswith(f"{adapter}-v") for model in fleet.frontend.asked)


async def test_another_adapters_update_commits_while_one_is_held(open_fleet: OpenFleet) -> None:
    fleet = await open_fleet(mode=UpdateMode.LIVE)
    release = _held(fleet, "alpha")
    alpha = _update(fleet, "alpha", 1)
    await _until(lambda: _asked_for(fleet, "alpha"))

    beta = await asyncio.wait_for(_update(fleet, "beta", 1), DEADLINE_S)
    status = fleet.coordinator.status()

    assert beta.committed, beta
    assert not alpha.done(), "beta waited for nothing: alpha is still held"
    # Each engine holds alpha's version too; a result lists its own adapter's.
    assert {w: o.adapters for w, o in beta.workers.items()} == {w: ["beta-v1"] for w in WORLD_SIZES}
    assert [(u.update_id, u.adapter, u.live) for u in status.running] == [
        ("alpha-1", "alpha", True)
    ]
    assert status.in_flight == "alpha-1"
    release.set()
    assert (await asyncio.wait_for(alpha, DEADLINE_S)).committed
    for engine in fleet.engines.values():
        assert {"alpha-v1", "beta-v1"} <= set(engine.adapters)
    assert fleet.coordinator.status().running == []


async def test_one_adapters_failure_fails_only_its_own_update(open_fleet: OpenFleet) -> None:
    """alpha's load fails on w1 while beta's update runs; beta is held until
    alpha has its answer, so the two overlap: alpha fails and its version is
    withdrawn, beta commits and keeps its version on every engine."""
    fleet = await open_fleet(mode=UpdateMode.LIVE)
    fleet.engines["w1"].refused = ("alpha-",)
    release = _held(fleet, "beta")
    beta = _update(fleet, "beta", 1)
    await _until(lambda: _asked_for(fleet, "beta"))

    alpha = await asyncio.wait_for(_update(fleet, "alpha", 1), DEADLINE_S)
    assert not beta.done()
    release.set()
    beta_result = await asyncio.wait_for(beta, DEADLINE_S)

    assert alpha.status == "failed" and alpha.error is not None, alpha
    assert beta_result.committed, beta_result
    for engine in fleet.engines.values():
        assert "alpha-v1" not in engine.adapters
        assert "beta-v1" in engine.adapters
    store = await FleetStore.open(fleet.server.connect("test-store"), fleet.config)  # type: ignore[arg-type]
    assert await store.read_committed("alpha") is None
    committed = await store.read_committed("beta")
    assert committed is not None and committed.version == 1
    assert await store.read_inflights() == []


async def test_pause_mode_updates_of_two_adapters_never_pause_together(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet(mode=UpdateMode.PAUSE)
    release = _held(fleet, "alpha")
    alpha = _update(fleet, "alpha", 1)
    await _until(lambda: _asked_for(fleet, "alpha"))
    beta = _update(fleet, "beta", 1)
    await asyncio.sleep(2.0)

    assert not beta.done(), "beta's pause waits for alpha's to end"
    assert [u.update_id for u in fleet.coordinator.status().running] == ["alpha-1"]
    release.set()
    results = await asyncio.wait_for(asyncio.gather(alpha, beta), DEADLINE_S)

    assert all(result.committed for result in results), results
    for engine in fleet.engines.values():
        calls = [call for call in engine.calls if call in ("pause", "resume")]
        # (An agent that starts resumes its engine once, whatever it finds.)
        assert calls[calls.index("pause") :] == ["pause", "resume"] * 2, engine.calls
        assert not engine.paused


async def test_pause_mode_updates_queued_together_share_one_pause_of_each_engine(
    open_fleet: OpenFleet,
) -> None:
    """Three tenants' pause-mode updates queue while another round runs; when
    it ends they start as one round: each engine pauses once for all three
    (each pause names the others), loads the three versions, and resumes
    once the last of them has resumed it."""
    fleet = await open_fleet(mode=UpdateMode.PAUSE)
    release = _held(fleet, "zeta")
    first = _update(fleet, "zeta", 1)
    await _until(lambda: _asked_for(fleet, "zeta"))
    tenants = [_update(fleet, adapter, 1) for adapter in ("alpha", "beta", "gamma")]
    await _until(lambda: fleet.coordinator.book.queued == 3)
    release.set()
    results = await asyncio.wait_for(asyncio.gather(first, *tenants), DEADLINE_S)

    assert all(result.committed for result in results), results
    for worker_id, engine in fleet.engines.items():
        calls = [call for call in engine.calls if call in ("pause", "resume")]
        # zeta's round, then one pause and one resume for the three.
        assert calls[calls.index("pause") :] == ["pause", "resume"] * 2, (worker_id, calls)
        assert {"alpha-v1", "beta-v1", "gamma-v1"} <= set(engine.adapters)
        assert not engine.paused
    pauses = [
        command
        for _, command in fleet.commands
        if isinstance(command, PauseCommand) and command.update_id != "zeta-1"
    ]
    assert {c.update_id: sorted(c.shared_with) for c in pauses} == {
        "alpha-1": ["beta-1", "gamma-1"],
        "beta-1": ["alpha-1", "gamma-1"],
        "gamma-1": ["alpha-1", "beta-1"],
    }


async def test_a_successor_rolls_back_every_update_in_flight_and_each_requester_hears(
    open_fleet: OpenFleet,
) -> None:
    """Two live updates of different adapters are held in their verify when
    the leader's link goes silent. The standby finds both in-flight records,
    rolls each back (withdrawing its version), and each requester, asking
    again, hears its own roll-back; the next updates commit."""
    fleet = await open_fleet(mode=UpdateMode.LIVE, leader_lease_s=2.0)
    standby = await fleet.start_coordinator("c2", leader_lease_s=2.0)
    for adapter in ("alpha", "beta"):
        _held(fleet, adapter)
    asked = [_update(fleet, adapter, 1) for adapter in ("alpha", "beta")]
    await _until(lambda: _asked_for(fleet, "alpha") and _asked_for(fleet, "beta"))
    store = await FleetStore.open(fleet.server.connect("test-store"), fleet.config)  # type: ignore[arg-type]
    assert sorted(r.adapter for r in await store.read_inflights()) == ["alpha", "beta"]
    fleet.connections["coordinator"].cut()

    answers = await asyncio.wait_for(asyncio.gather(*asked), DEADLINE_S)
    for answer in answers:
        assert answer.error is not None and answer.error.code == ErrorCode.FAILOVER, answer
    assert standby.leading.is_set()
    assert await in_flight_of(store) is None
    for engine in fleet.engines.values():
        assert not {"alpha-v1", "beta-v1"} & set(engine.adapters), engine.adapters
    fleet.frontend.holds.clear()
    after = await asyncio.wait_for(
        asyncio.gather(_update(fleet, "alpha", 2), _update(fleet, "beta", 2)), DEADLINE_S
    )
    assert all(result.committed for result in after), after


async def test_a_successor_rolls_back_a_round_that_shares_a_pause_and_every_engine_resumes(
    open_fleet: OpenFleet,
) -> None:
    """Two pause-mode updates share one pause of each engine when the leader's
    link goes silent in their verify. The standby's resumes (of its own, later
    term) do not wait for the dead term's holds: every engine resumes, well
    before its pause lease runs out, and both requesters hear the roll-back."""
    fleet = await open_fleet(mode=UpdateMode.PAUSE, leader_lease_s=2.0, pause_lease_s=300)
    standby = await fleet.start_coordinator("c2", leader_lease_s=2.0, pause_lease_s=300)
    release = _held(fleet, "zeta")
    first = _update(fleet, "zeta", 1)
    await _until(lambda: _asked_for(fleet, "zeta"))
    for adapter in ("alpha", "beta"):
        _held(fleet, adapter)
    asked = [_update(fleet, adapter, 1) for adapter in ("alpha", "beta")]
    await _until(lambda: fleet.coordinator.book.queued == 2)
    release.set()
    assert (await asyncio.wait_for(first, DEADLINE_S)).committed
    await _until(lambda: _asked_for(fleet, "alpha") and _asked_for(fleet, "beta"))
    assert all(engine.paused for engine in fleet.engines.values())
    cut_at = asyncio.get_running_loop().time()
    fleet.connections["coordinator"].cut()

    answers = await asyncio.wait_for(asyncio.gather(*asked), DEADLINE_S)
    for answer in answers:
        assert answer.error is not None and answer.error.code == ErrorCode.FAILOVER, answer
    assert standby.leading.is_set()
    await _until(lambda: not any(engine.paused for engine in fleet.engines.values()))
    assert asyncio.get_running_loop().time() - cut_at < 60, (
        "resumed by its lease, not the roll-back"
    )
    for engine in fleet.engines.values():
        assert not {"alpha-v1", "beta-v1"} & set(engine.adapters), engine.adapters


async def test_retiring_put_off_by_another_adapters_pause_runs_once_the_engine_resumes(
    open_fleet: OpenFleet,
) -> None:
    """alpha's v2 commits live while beta's pause holds every engine: the
    agents put off unloading alpha-v1 (an engine may refuse to unload while
    paused) and do it once beta's round resumes them, not at alpha's next
    commit, which may never come. (With the canary, alpha's commit waits for
    the engines to run again: a paused engine holds generations.)"""
    fleet = await open_fleet(mode=UpdateMode.PAUSE, keep=1, canary=False)
    assert (await asyncio.wait_for(_update(fleet, "alpha", 1), DEADLINE_S)).committed
    release = _held(fleet, "beta")
    beta = _update(fleet, "beta", 1)
    await _until(lambda: _asked_for(fleet, "beta"))
    live = await asyncio.wait_for(
        fleet.client().update(
            "alpha", "/adapters/alpha/2", version=2, update_id="alpha-2", mode=UpdateMode.LIVE
        ),
        DEADLINE_S,
    )
    assert live.committed, live
    await asyncio.sleep(1.0)
    assert all("alpha-v1" in engine.adapters for engine in fleet.engines.values()), (
        "retired while paused"
    )
    release.set()
    assert (await asyncio.wait_for(beta, DEADLINE_S)).committed
    await _until(lambda: not any("alpha-v1" in e.adapters for e in fleet.engines.values()))
    for engine in fleet.engines.values():
        assert {"alpha-v2", "beta-v1"} <= set(engine.adapters)
