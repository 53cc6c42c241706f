"""The canary phase with the real agents and the real coordinator, in memory.

Each engine may list a served name it does not serve (``unroutable``, as a
Dynamo worker whose load succeeded but whose route was never published):
only a generation finds it. The canary runs after the resume in pause mode
(a paused engine holds generations), after the load in live mode, on every
member and then once through the frontend; a member that does not answer
fails the update, or is left out as the quorum allows, and the version is
unloaded wherever it loaded.
"""

from __future__ import annotations

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


async def test_with_a_partial_quorum_the_replica_is_left_out_and_unloads_the_version(
    open_fleet: OpenFleet,
) -> None:
    fleet = await open_fleet(quorum=0.8)  # 7 of 8 ranks: w2 (world size 1) may go
    fleet.engines["w2"].unroutable = {"policy-v1"}
    result = await _update(fleet, mode=UpdateMode.LIVE)

    assert result.committed, result.error
    assert result.rank_map is not None
    assert [e.worker_id for e in result.rank_map.entries] == ["w0", "w1"]
    left_out = result.workers["w2"]
    assert left_out.error is not None and left_out.error.code == ErrorCode.CANARY_FAILED
    assert "policy-v1" not in fleet.engines["w2"].adapters
    assert all("policy-v1" in fleet.engines[w].adapters for w in ("w0", "w1"))


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
