"""Results and status replies that would outgrow the bus's message size limit
are trimmed, step by step and said so, instead of never reaching anyone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from lorabus.audit.render import result_text, status_text, update_progress_text
from lorabus.bus.connect import close, connect
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.fit import ERROR_DETAIL_CHARS, fit_result, fit_status
from lorabus.coordinator.store import FleetStore
from lorabus.schemas import (
    MAX_MESSAGE_BYTES,
    ErrorInfo,
    FleetStatus,
    MemberStatus,
    UpdateResult,
    WorkerOutcome,
    build_rank_map,
    encode,
)
from lorabus.schemas.errors import ErrorCode
from lorabus.testbed.natsserver import NatsServer
from lorabus.testbed.stack import EmbeddedStack

WORKERS = 8
HELD_BEFORE = 30
"""Adapters each worker already holds: with 200-character names, each
worker's list is about 6 KB, and the fleet's together over the limit below."""
LONG = "policy-" + "x" * 120
"""An adapter whose served names are long (about 130 characters)."""
MAX_PAYLOAD = 32 * 1024
DEADLINE_S = 10.0


def _size(message: UpdateResult | FleetStatus) -> int:
    return len(encode(message))


def _result(workers: int, failed: int, adapters: int) -> UpdateResult:
    names = [f"other-{i:03d}-" + "x" * 200 for i in range(adapters)]
    outcomes = {
        f"w{i:04d}": WorkerOutcome(
            ok=i >= failed,
            world_size=2,
            adapters=names,
            error=(
                ErrorInfo(code=ErrorCode.ENGINE_ERROR, message="engine said: " + "e" * 3000)
                if i < failed
                else None
            ),
        )
        for i in range(workers)
    }
    return UpdateResult(
        update_id="u1",
        status="failed" if failed else "committed",
        adapter="policy-v1",
        version=1,
        rank_map=build_rank_map({wid: 2 for wid in outcomes}),
        workers=outcomes,
    )


def test_a_result_that_fits_is_left_whole() -> None:
    result = _result(workers=4, failed=1, adapters=3)

    assert fit_result(result, 1 << 20) == result


@pytest.mark.parametrize(
    ("limit", "trimmed"),
    [
        (400_000, ["adapters"]),
        (150_000, ["adapters", "serving_workers"]),
        (60_000, ["adapters", "serving_workers", "error_detail"]),
    ],
)
def test_a_result_leaves_out_what_a_reader_can_do_without_first(
    limit: int, trimmed: list[str]
) -> None:
    result = _result(workers=400, failed=40, adapters=10)
    assert _size(result) > 400_000

    fitted = fit_result(result, limit)

    assert fitted.trimmed == trimmed
    assert _size(fitted) <= limit
    # What a result may never lose: its status, rank map and every failure.
    assert (fitted.status, fitted.rank_map, fitted.error) == (
        result.status,
        result.rank_map,
        result.error,
    )
    failed = {wid for wid, outcome in result.workers.items() if not outcome.ok}
    assert failed <= set(fitted.workers)
    assert all(fitted.workers[wid].error is not None for wid in failed)
    cut = "error_detail" in trimmed
    for wid in failed:
        message = fitted.workers[wid].error.message  # type: ignore[union-attr]
        assert len(message) == (ERROR_DETAIL_CHARS + 3 if cut else len("engine said: ") + 3000)
    if "serving_workers" not in trimmed:
        assert set(fitted.workers) == set(result.workers)


def test_no_result_is_made_larger_than_a_reader_accepts_whatever_the_server_allows() -> None:
    result = _result(workers=1200, failed=0, adapters=10)
    assert _size(result) > MAX_MESSAGE_BYTES

    fitted = fit_result(result, 64 * MAX_MESSAGE_BYTES)

    assert fitted.trimmed and _size(fitted) <= MAX_MESSAGE_BYTES


def test_a_status_leaves_out_adapter_lists_then_phase_members_then_the_rank_map() -> None:
    names = ["n" * 100] * 3
    rank_map = build_rank_map({f"w{i:04d}": 1 for i in range(1000)})
    members = [
        MemberStatus(
            worker_id=entry.worker_id,
            world_size=1,
            engine="dynamo",
            paused=True,
            adapters=names,
            heartbeat_age_s=0.5,
            rank_offset=entry.rank_offset,
        )
        for entry in rank_map.entries
    ]
    waiting = [m.worker_id for m in members]
    status = FleetStatus(
        fleet="f",
        expected_world_size=1000,
        live_world_size=1000,
        members=members,
        rank_map=rank_map,
        in_flight="u1",
        in_flight_phase="pause",
        waiting=waiting,
    )
    whole = _size(status)
    without_adapters = _size(fit_status(status, whole - 1))
    assert without_adapters < whole

    steps = [
        (whole, []),
        (without_adapters, ["adapters"]),
        (without_adapters - 1, ["adapters", "phase_members"]),
    ]
    for limit, trimmed in steps:
        fitted = fit_status(status, limit)
        assert fitted.trimmed == trimmed
        assert _size(fitted) <= limit
        assert [m.worker_id for m in fitted.members] == waiting
    smallest = fit_status(status, 1000)  # fits nothing: the most trimmed form
    assert smallest.trimmed == ["adapters", "phase_members", "rank_map", "ready_members"]
    assert smallest.rank_map is None
    # Every member is paused: an operator must see each one.
    assert [m.rank_offset for m in smallest.members] == [m.rank_offset for m in members]

    text = status_text(fit_status(status, without_adapters - 1))
    assert "left out to fit the bus's message size limit: adapters, phase_members" in text
    assert "pause, 0/0 acked" not in text
    progress = update_progress_text("u1", fit_status(status, without_adapters - 1))
    assert "0 of 0 acked" not in progress and "phase_members" in progress


def test_a_status_of_4096_members_fits_and_past_that_keeps_the_members_not_ready() -> None:
    def fleet(n: int) -> FleetStatus:
        rank_map = build_rank_map({f"w{i:05d}": 1 for i in range(n)})
        members = [
            MemberStatus(
                worker_id=entry.worker_id,
                world_size=1,
                engine="dynamo",
                paused=False,
                adapters=["policy-v1"],
                heartbeat_age_s=0.5,
                rank_offset=entry.rank_offset,
                ready=entry.worker_id != "w00007",
                unready_reason="" if entry.worker_id != "w00007" else "missing policy-v1",
            )
            for entry in rank_map.entries
        ]
        return FleetStatus(
            fleet="f", expected_world_size=n, live_world_size=n, members=members, rank_map=rank_map
        )

    limit = 1024 * 1024
    fitted = fit_status(fleet(4096), limit)
    assert _size(fitted) <= limit and len(fitted.members) == 4096, fitted.trimmed
    assert "ready_members" not in fitted.trimmed

    huge = fit_status(fleet(20000), limit)
    assert _size(huge) <= limit
    assert huge.trimmed[-1] == "ready_members"
    assert [(m.worker_id, m.unready_reason) for m in huge.members] == [
        ("w00007", "missing policy-v1")
    ]
    assert huge.live_world_size == 20000


async def test_an_update_whose_result_outgrows_the_server_limit_is_answered_trimmed(
    tmp_path: Path,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    conf = tmp_path / "small-payloads.conf"
    conf.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    async with NatsServer(include=conf) as server:
        async with EmbeddedStack(
            [1] * WORKERS, fleet=fleet_name, nats_url=server.url, heartbeat_s=0.2, keep=1
        ) as stack:
            assert stack.client is not None and stack.sim is not None
            # Other adapters fill each engine's list (the status must trim);
            # versions of this adapter of an earlier lineage fill the part a
            # result lists (its own adapter's names: the result must trim).
            held = [f"other-{i:02d}-" + "x" * 200 for i in range(HELD_BEFORE)]
            earlier = [f"{LONG}-r9-v{i}" for i in range(HELD_BEFORE)]
            for worker in stack.sim.workers.values():
                for name in held + earlier:
                    worker.add_adapter(name, f"/adapters/{name}")

            result = await stack.client.update(LONG, make_adapter(1), version=1, timeout_s=30)
            by_id = await stack.client.result(result.update_id, timeout_s=10)
            status = await stack.client.status(timeout_s=10)
            # What a successor, or `lorabus result` a day later, reads.
            nc = await connect(server.url, name="test-store-reader")
            try:
                store = await _store_of(nc, fleet_name)
                # A commit's result is stored just after its answer.
                async with asyncio.timeout(10):
                    while (stored := await store.read_result(result.update_id)) is None:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)
            finally:
                await close(nc)
            # The versions beyond --keep are still retired: the coordinator
            # reads what the engines hold from the whole result, not the one sent.
            async with asyncio.timeout(DEADLINE_S):
                for worker in stack.sim.workers.values():
                    await worker.wait_until(lambda w=worker: not set(earlier) & set(w.adapters))
            second = await stack.client.update(LONG, make_adapter(2), version=2, timeout_s=30)
            async with asyncio.timeout(DEADLINE_S):
                for worker in stack.sim.workers.values():
                    await worker.wait_until(lambda w=worker: f"{LONG}-v1" not in w.adapters)

    assert result.committed, result.error
    assert result.trimmed == ["adapters"]
    assert sorted(result.workers) == sorted(stack.sim.workers)
    assert all(o.ok and o.adapters == [] for o in result.workers.values())
    assert result.rank_map is not None and len(result.rank_map.entries) == WORKERS
    assert "left out to fit the bus's message size limit: adapters" in result_text(result)
    assert by_id == result == stored  # the stored result is the one answered
    assert second.committed and second.trimmed == [], second.error
    for worker in stack.sim.workers.values():
        assert f"{LONG}-v2" in worker.adapters and not worker.paused
        assert set(held) <= set(worker.adapters)  # not versions of the adapter: kept
    assert status.trimmed == ["adapters"]
    assert sorted(m.worker_id for m in status.members) == sorted(stack.sim.workers)


async def test_a_stored_result_too_large_for_a_reader_is_answered_trimmed(
    tmp_path: Path, fleet_name: str
) -> None:
    """One stored before results were trimmed, on a server that carries more
    than the 1 MiB any lorabus reader accepts."""
    conf = tmp_path / "big-payloads.conf"
    conf.write_text(f"max_payload: {4 * MAX_MESSAGE_BYTES}\n")
    old = msgspec.structs.replace(_result(workers=1200, failed=0, adapters=10), update_id="old-1")
    assert _size(old) > MAX_MESSAGE_BYTES
    async with NatsServer(include=conf) as server:
        async with EmbeddedStack([1], fleet=fleet_name, nats_url=server.url) as stack:
            assert stack.client is not None
            nc = await connect(server.url, name="test-store-writer")
            try:
                store = await _store_of(nc, fleet_name)
                await store.write_result(old)
            finally:
                await close(nc)

            answer = await stack.client.result("old-1", timeout_s=10)

    assert answer.committed and answer.trimmed, answer.status
    assert answer.rank_map == old.rank_map
    assert _size(answer) <= MAX_MESSAGE_BYTES


async def _store_of(nc: NatsClient, fleet: str) -> FleetStore:
    """The fleet's buckets, as a successor or a later `lorabus result` reads them."""
    config = CoordinatorConfig(
        fleet=fleet, frontend_url="http://frontend.invalid", expected_world_size=1
    )
    return await FleetStore.open(nc, config)
