"""Tenants on one fleet: each asks on its own subjects, for its own adapters,
within its quotas (coordinator/tenants.py).

The real coordinator and agents on the in-memory bus. What the bus's
permissions keep a tenant from (publishing on another's subjects, purging
the store) is tested against a real server in test_tenants_secure.py; here,
what the coordinator holds a tenant to, from the subject it asked on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from memory_fleet import InMemoryFleet

from lorabus.schemas import (
    UNKNOWN,
    ErrorCode,
    RequestRefused,
    UpdateRequest,
    encode,
    event_decoder,
)
from lorabus.schemas.tenants import Tenant, encode_tenants

pytestmark = pytest.mark.looptime


def _tenants_file(tmp_path: Path, **tenants: Tenant) -> str:
    path = tmp_path / "tenants.json"
    path.write_bytes(encode_tenants(dict(tenants)))
    return str(path)


def _fleet(tmp_path: Path, *, max_adapters: int = 2, **settings: object) -> InMemoryFleet:
    tenants = _tenants_file(
        tmp_path,
        a=Tenant(
            adapters="a-*",
            max_queued=2,
            max_adapters=max_adapters,
            max_keep=3,
            roots=["/adapters/a", "/adapters/a2", "/adapters/a3"],
        ),
        b=Tenant(adapters="b-*", roots=["/adapters/b"]),
    )
    return InMemoryFleet({"w0": 1, "w1": 2}, tenants_file=tenants, **settings)


async def _refusals(fleet: InMemoryFleet) -> list[RequestRefused]:
    """Start collecting the fleet's ``request_refused`` events."""
    seen: list[RequestRefused] = []

    async def on_event(msg: object) -> None:
        event = event_decoder.decode(msg.data)  # type: ignore[attr-defined]
        if isinstance(event, RequestRefused):
            seen.append(event)

    await fleet.server.connect("events").subscribe(fleet.subjects.event_any(), cb=on_event)
    return seen


async def test_a_tenant_updates_its_own_adapters_and_sees_only_them(tmp_path: Path) -> None:
    async with _fleet(tmp_path) as fleet:
        a, b = fleet.client("a"), fleet.client("b")
        mine = await a.update("a-policy", "/adapters/a/1", version=1)
        assert mine.committed, mine
        assert mine.update_id.startswith("a:")
        theirs = await b.update("b-policy", "/adapters/b/1", version=1)
        assert theirs.committed, theirs

        # Results: its own, and another's as an id nobody used.
        assert (await a.result(mine.update_id)).committed
        hidden = await a.result(theirs.update_id)
        assert hidden.status == UNKNOWN and hidden.adapter == "", hidden

        # Status: its own adapters; the members' lists cut to its names.
        seen = await a.status()
        assert [s.adapter for s in seen.adapters] == ["a-policy"]
        assert all(set(m.adapters) <= {"a-policy-v1"} for m in seen.members), seen.members
        assert {m.worker_id for m in seen.members} == {"w0", "w1"}
        assert seen.committed_adapter in (None, "a-policy")
        whole = await fleet.client().status()  # the generic orchestrator sees every adapter
        assert {s.adapter for s in whole.adapters} == {"a-policy", "b-policy"}


async def test_what_a_tenant_may_not_ask_is_refused_kept_nowhere_and_audited(
    tmp_path: Path,
) -> None:
    async with _fleet(tmp_path) as fleet:
        refusals = await _refusals(fleet)
        a, b = fleet.client("a"), fleet.client("b")
        committed = await b.update("b-policy", "/adapters/b/1", version=1)
        assert committed.committed

        # Another tenant's adapter: update, or supersede with a newer version.
        for version in (1, 2):
            forbidden = await a.update("b-policy", f"/adapters/b/{version}", update_id="a:x")
            assert forbidden.error is not None and forbidden.error.code == ErrorCode.FORBIDDEN
        # An id that is not its own (another's, or the generic role's).
        for update_id in ("b:step-2", "step-2"):
            not_its_id = await a.update("a-policy", "/adapters/a/1", update_id=update_id)
            assert not_its_id.error is not None, not_its_id
            assert not_its_id.error.code == ErrorCode.FORBIDDEN
        # Its own adapter from another's files on the workers: agents are no
        # deputies that load whatever path a tenant names.
        aimed = await a.update("a-policy", "/adapters/b/1", update_id="a:aimed")
        assert aimed.error is not None and aimed.error.code == ErrorCode.FORBIDDEN, aimed
        # More versions kept than its quota.
        kept = await a.update("a-policy", "/adapters/a/1", keep=4)
        assert kept.error is not None and kept.error.code == ErrorCode.QUOTA
        # A tenant the coordinator does not know.
        stranger = await fleet.client("c").update("c-policy", "/adapters/c/1")
        assert stranger.error is not None and stranger.error.code == ErrorCode.FORBIDDEN

        # Nothing of a refusal was kept: the id "a:x" is still free for a's own.
        reused = await a.update("a-policy", "/adapters/a/1", version=1, update_id="a:x")
        assert reused.committed, reused
        # Answered without running, a tenant's request is kept nowhere (its
        # results would fill the fleet's results bucket): asked about, unknown.
        stale = await a.update("a-policy", "/adapters/a/0", version=0)
        assert stale.error is not None and stale.error.code == ErrorCode.STALE_VERSION
        assert (await a.result(stale.update_id)).status == UNKNOWN
        # The orchestrator's own subject takes no tenant's ids.
        squatted = await fleet.client().update("b-policy", "/adapters/b/2", update_id="b:next")
        assert squatted.error is not None and squatted.error.code == ErrorCode.FORBIDDEN
        # A third adapter is past a's quota of two.
        assert (await a.update("a-second", "/adapters/a2/1", version=1)).committed
        third = await a.update("a-third", "/adapters/a3/1", version=1)
        assert third.error is not None and third.error.code == ErrorCode.QUOTA, third
        # b's adapter is as b left it.
        status = await fleet.client().status()
        assert {(s.adapter, s.version) for s in status.adapters} == {
            ("b-policy", 1),
            ("a-policy", 1),
            ("a-second", 1),
        }
        # Every refusal is in the trail, naming the tenant its subject proved.
        async with asyncio.timeout(5):
            while len(refusals) < 9:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert [(r.tenant, r.error.code) for r in refusals] == [
            ("a", ErrorCode.FORBIDDEN),
            ("a", ErrorCode.FORBIDDEN),
            ("a", ErrorCode.FORBIDDEN),
            ("a", ErrorCode.FORBIDDEN),
            ("a", ErrorCode.FORBIDDEN),
            ("a", ErrorCode.QUOTA),
            ("c", ErrorCode.FORBIDDEN),
            ("", ErrorCode.FORBIDDEN),  # on the orchestrator's subject
            ("a", ErrorCode.QUOTA),
        ]


async def test_a_tenant_cannot_name_a_field_to_pass_as_another(tmp_path: Path) -> None:
    """The tenant is the subject's, whatever the message holds: a request on
    a's subject with b's id and b's adapter is a's, and refused."""
    async with _fleet(tmp_path) as fleet:
        request = UpdateRequest(
            update_id="b:1", adapter="b-policy", path="/adapters/b/1", version=1
        )
        conn = fleet.server.connect("raw")
        reply = await conn.request(
            fleet.subjects.tenant_request("a", "update"), encode(request), timeout=30
        )
        assert b'"forbidden"' in reply.data
        assert not (await fleet.client().status()).adapters


async def test_a_tenants_quotas_bound_its_queue_and_its_adapters(tmp_path: Path) -> None:
    """a may queue 2 and hold 3 adapters; b's updates go on meanwhile."""
    async with _fleet(tmp_path, max_adapters=3, max_concurrent=1) as fleet:
        refusals = await _refusals(fleet)
        a, b = fleet.client("a"), fleet.client("b")
        held = asyncio.Event()

        async def slow_load() -> None:
            await held.wait()

        for engine in fleet.engines.values():
            engine.on_load = slow_load
        running = asyncio.ensure_future(a.update("a-one", "/adapters/a/1", version=1))
        await asyncio.sleep(1.0)  # a-one runs, holding the only slot
        queued = [
            asyncio.ensure_future(a.update("a-one", f"/adapters/a/{v}", version=v)) for v in (2, 3)
        ]
        await asyncio.sleep(1.0)
        # a's versions 2 and 3 of one adapter: 3 superseded 2, so one waits.
        second = asyncio.ensure_future(a.update("a-two", "/adapters/a2/1", version=1))
        await asyncio.sleep(1.0)
        # a's queue holds 2 (a-one v3, a-two): one more is busy, not kept.
        busy = await a.update("a-three", "/adapters/a3/1", version=1, timeout_s=5)
        assert busy.error is not None and busy.error.code == ErrorCode.BUSY, busy
        assert "tenant 'a'" in busy.error.message
        # b is bounded by its own quota, not a's: it queues behind.
        theirs = asyncio.ensure_future(b.update("b-policy", "/adapters/b/1", version=1))
        held.set()
        results = await asyncio.gather(running, *queued, second, theirs)
        assert [r.status for r in results] == [
            "committed",
            "failed",  # superseded by version 3
            "committed",
            "committed",
            "committed",
        ], results
        assert refusals == []  # busy is no refusal: the same request may come again


async def test_one_tenants_flood_of_refusals_keeps_no_other_out_of_the_trail(
    tmp_path: Path,
) -> None:
    """Refusal events are budgeted per tenant: a's flood fills a's budget
    for the second (the rest are answered and logged, not audited), and b's
    refusal in that same second is still in the trail."""
    async with _fleet(tmp_path) as fleet:
        refusals = await _refusals(fleet)
        a, b = fleet.client("a"), fleet.client("b")
        started = asyncio.get_running_loop().time()
        flood = await asyncio.gather(
            *(a.update("b-policy", "/adapters/b/1", update_id=f"a:x{k}") for k in range(30))
        )
        assert all(r.error is not None and r.error.code == ErrorCode.FORBIDDEN for r in flood)
        theirs = await b.update("a-policy", "/adapters/a/1", update_id="b:y")
        assert theirs.error is not None and theirs.error.code == ErrorCode.FORBIDDEN
        assert asyncio.get_running_loop().time() - started < 1.0  # one second's budget
        async with asyncio.timeout(5):
            while not any(r.tenant == "b" for r in refusals):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert sum(r.tenant == "a" for r in refusals) == 10
