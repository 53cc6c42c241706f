"""The canary phase with the real agents and the real coordinator, in memory.

Each engine may list a served name it does not serve (``unroutable``, as a
Dynamo worker whose load succeeded but whose route was never published):
only a generation finds it. The canary runs after the resume in pause mode
(a paused engine holds generations), after the load in live mode, on every
member and then once through the frontend; a member that does not answer
fails the update whatever the quorum allows, and the version is unloaded
wherever it loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import pytest
from memory_fleet import InMemoryFleet

from lorabus.schemas import CanaryCommand, ErrorCode, Phase, UpdateMode, UpdateResult

pytestmark = pytest.mark.looptime

WORLD_SIZES = {"w0": 2, "w1": 4, "w2": 1}
OpenFleet = Callable[..., Any]


@pytest.fixture
async def open_fleet() -> AsyncIterator[OpenFleet]:
    async with AsyncExitStack() as stack:

        async def open_(**settings: Any) -> InMemoryFleet:
            return await stack.enter_async_context(InMemoryFleet(WORLD_SIZES, **settings))

        yield open_


async def _update(fleet: InMemoryFleet, **asked: Any) -> UpdateResult:
    return await fleet.client().update(
        "policy", "/adapters/policy/step_1", version=1, update_id="u1", timeout_s=600, **asked
    )


def _canaries_sent(fleet: InMemoryFleet, worker_id: str) -> list[CanaryCommand]:
    return [c for c in fleet.sent_to(worker_id) if isinstance(c, CanaryCommand)]


@pytest.mark.parametrize("mode", [UpdateMode.PAUSE, UpdateMode.LIVE])
async def test_every_member_and_the_frontend_answer_before_the_commit(
    open_fleet: OpenFleet, mode: UpdateMode
) -> None:
    fleet = await open_fleet()
    result = await _update(fleet, mode=mode)

    assert result.committed, result.error
    assert Phase.CANARY in result.phases
    for worker_id, engine in fleet.engines.items():
        assert engine.canaries == ["policy-v1"], worker_id
        assert [c.served_name for c in _canaries_sent(fleet, worker_id)] == ["policy-v1"]
    assert fleet.frontend.generated == ["policy-v1"]


async def test_a_replica_that_lists_the_version_but_does_not_serve_it_fails_the_update(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet()
    fleet.engines["w1"].unroutable = {"policy-v1"}
    result = await _update(fleet)

    assert not result.committed
    assert result.error is not None and result.error.code == ErrorCode.CANARY_FAILED
    outcome = result.workers["w1"]
    assert outcome.error is not None and outcome.error.code == ErrorCode.CANARY_FAILED
    assert "w1" in outcome.error.message and "does not exist" in outcome.error.message
    assert all(result.workers[w].ok for w in ("w0", "w2"))
    # Withdrawn wherever it loaded, and nothing is left paused.
    for worker_id, engine in fleet.engines.items():
        assert "policy-v1" not in engine.adapters, worker_id
        assert not engine.paused, worker_id
    assert fleet.frontend.generated == []  # the members' failure ends the phase


async def test_whatever_the_quorum_a_replica_that_does_not_serve_fails_the_update(
    open_fleet: OpenFleet,
) -> None:
    """Left out, it would still list the name, and its agent would load the
    committed version again at its next look: as with other bytes under one
    name, the quorum does not let an update go on without it."""
    fleet = await open_fleet(quorum=0.8)  # 7 of 8 ranks: w2 (world size 1) could go
    fleet.engines["w2"].unroutable = {"policy-v1"}
    result = await _update(fleet, mode=UpdateMode.LIVE)

    assert not result.committed
    assert result.error is not None and result.error.code == ErrorCode.CANARY_FAILED
    failed = result.workers["w2"]  # named in live mode too, with its engine's answer
    assert failed.error is not None and failed.error.code == ErrorCode.CANARY_FAILED
    assert "does not exist" in failed.error.message
    assert result.workers["w0"].ok and result.workers["w1"].ok
    assert all("policy-v1" not in e.adapters for e in fleet.engines.values())


async def test_a_frontend_that_does_not_answer_the_name_fails_the_update(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet()
    # Every replica serves it, but the frontend does not route it (a model card
    # registered with the wrong KV block size: Dynamo #11866).
    fleet.frontend.unanswered = {"policy-v1"}
    result = await _update(fleet, mode=UpdateMode.LIVE)

    assert not result.committed
    assert result.error is not None and result.error.code == ErrorCode.CANARY_FAILED
    assert "frontend" in result.error.message
    assert fleet.frontend.generated == ["policy-v1"]
    assert all("policy-v1" not in e.adapters for e in fleet.engines.values())


async def test_a_fleet_with_the_canary_off_asks_no_generation(open_fleet: OpenFleet) -> None:
    fleet = await open_fleet(canary=False)
    fleet.engines["w1"].unroutable = {"policy-v1"}
    result = await _update(fleet)

    assert result.committed, result.error
    assert Phase.CANARY not in result.phases
    assert all(_canaries_sent(fleet, w) == [] for w in WORLD_SIZES)
    assert fleet.frontend.generated == []


async def test_a_round_mates_slow_verify_does_not_fail_anothers_canary(
    open_fleet: OpenFleet,
) -> None:
    """alpha and beta share one pause; beta's frontend listing takes 45 s (its
    verify may take 60). The engines stay paused for beta meanwhile, so
    alpha's canary waits for the round to resume them, then both commit:
    one adapter's slowness is not another's failure."""
    fleet = await open_fleet(mode=UpdateMode.PAUSE)
    release = _held(fleet, "zeta")
    first = _update_task(fleet, "zeta")
    await _until(lambda: "zeta-v1" in fleet.frontend.asked)
    slow = _held(fleet, "beta")
    round_ = [_update_task(fleet, adapter) for adapter in ("alpha", "beta")]
    await _until(lambda: fleet.coordinator.book.queued == 2)
    release.set()
    await _until(lambda: "beta-v1" in fleet.frontend.asked)
    await asyncio.sleep(45)
    slow.set()
    results = await asyncio.wait_for(asyncio.gather(first, *round_), 120)

    assert all(r.committed for r in results), [r.error for r in results]
    for engine in fleet.engines.values():
        assert {"alpha-v1", "beta-v1"} <= set(engine.adapters)
        assert engine.canaries.count("alpha-v1") == 1 and not engine.paused


async def test_a_live_update_during_anothers_pause_commits_once_it_is_over(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet(mode=UpdateMode.PAUSE)
    release = _held(fleet, "beta")
    beta = _update_task(fleet, "beta")
    await _until(lambda: "beta-v1" in fleet.frontend.asked)
    alpha = _update_task(fleet, "alpha", mode=UpdateMode.LIVE)
    await _until(lambda: all("alpha-v1" in e.adapters for e in fleet.engines.values()))
    await asyncio.sleep(45)  # beta's pause holds the engines well past a phase timeout
    assert not alpha.done()
    release.set()

    results = await asyncio.wait_for(asyncio.gather(alpha, beta), 120)

    assert all(r.committed for r in results), [r.error for r in results]
    assert all(e.canaries.count("alpha-v1") == 1 for e in fleet.engines.values())


def _held(fleet: InMemoryFleet, adapter: str) -> asyncio.Event:
    """Hold ``adapter``'s verify (the frontend does not list it) until set."""
    released = fleet.frontend.holds[f"{adapter}-v"] = asyncio.Event()
    return released


def _update_task(
    fleet: InMemoryFleet, adapter: str, mode: UpdateMode | None = None
) -> asyncio.Task[UpdateResult]:
    return asyncio.create_task(
        fleet.client().update(
            adapter,
            f"/adapters/{adapter}/1",
            version=1,
            update_id=f"{adapter}-1",
            timeout_s=600,
            **({"mode": mode} if mode else {}),
        )
    )


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(120):
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(0.02)
