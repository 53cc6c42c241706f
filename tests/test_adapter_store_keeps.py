"""Nothing committed is ever lost from the adapter store: what the leader may
delete is decided from the state bucket's records (every adapter's commit
point and the versions kept beside it, a reset's, the update in flight) and
the requests it holds, read when it deletes; a successor that finishes a
commit does what the term that ran it would have.

A real nats-server, the real coordinator and agents, a simulated fleet; the
state a leader leaves when it dies is written as it leaves it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from adapter_dirs import write_adapter
from store_helpers import leave_a_claimed_commit

from lorabus.adapters.bus_paths import bus_path
from lorabus.adapters.store import object_size, push_adapter
from lorabus.bus.connect import close, connect
from lorabus.coordinator import adapter_store
from lorabus.coordinator.adapter_store import AdapterStore, delete_unkept, keepers, kept_beside
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.store import CorruptRecord, FleetStore
from lorabus.errors import BadRequest
from lorabus.schemas import (
    CommittedRecord,
    KeptVersion,
    ResetRecord,
    Subjects,
    build_rank_map,
)
from lorabus.testbed.stack import EmbeddedStack

MEMBERS = {"w000": 1, "w001": 2}
D = ["sha256:" + f"{n:x}" * 64 for n in range(1, 6)]


def _committed(version: int, digest: str, kept: list[KeptVersion]) -> CommittedRecord:
    return CommittedRecord(
        adapter="policy",
        version=version,
        path=bus_path(digest),
        served_name=f"policy-v{version}",
        rank_map=build_rank_map(MEMBERS),
        digest=digest,
        kept=kept,
    )


def _kept(version: int, digest: str) -> KeptVersion:
    return KeptVersion(
        version=version, served_name=f"policy-v{version}", path=bus_path(digest), digest=digest
    )


def test_a_commit_keeps_the_newest_versions_beside_it_and_drops_the_rest() -> None:
    v2 = _committed(2, D[1], [_kept(1, D[0])])

    def beside(version: int, path: str, keep: int) -> tuple[list[KeptVersion], list[str]]:
        return kept_beside(f"policy-v{version}", path, v2, None, keep=keep)

    assert beside(3, bus_path(D[2]), keep=2) == ([_kept(2, D[1])], [D[0]])
    assert beside(3, bus_path(D[2]), keep=3) == ([_kept(2, D[1]), _kept(1, D[0])], [])
    # The same bytes again as a new version: the commit's object, not dropped.
    assert beside(3, bus_path(D[0]), keep=2) == ([_kept(2, D[1])], [])
    # A commit from a filesystem path keeps its earlier versions all the same.
    assert beside(3, "/adapters/step_3", keep=2) == ([_kept(2, D[1])], [D[0]])
    # keep 1: nothing beside the commit.
    assert beside(3, bus_path(D[2]), keep=1) == ([], [D[0], D[1]])
    # Fixed naming reloads one name in place: no version is kept beside it.
    fixed = kept_beside("policy-v2", bus_path(D[2]), v2, None, keep=2)
    assert fixed == ([_kept(1, D[0])], [D[1]])
    # After a reset: what the reset kept, until this commit keeps it beside it.
    reset = ResetRecord(
        adapter="policy",
        lineage=1,
        previous_version=2,
        previous_path=bus_path(D[1]),
        reason="test",
        ts=0.0,
        kept=[_kept(2, D[1]), _kept(1, D[0])],
    )
    assert kept_beside("policy-r1-v1", bus_path(D[2]), None, reset, keep=2) == (
        [_kept(2, D[1])],
        [D[0]],
    )
    assert kept_beside("policy-v3", bus_path(D[2]), None, None, keep=2) == ([], [])


async def _leading() -> bool:
    return True


def _write_adapter(root: Path, weights: bytes) -> str:
    return str(write_adapter(root, weights))


def _config(fleet: str) -> CoordinatorConfig:
    return CoordinatorConfig(
        fleet=fleet, frontend_url="http://frontend.invalid", expected_world_size=3
    )


async def test_a_commit_a_successor_finished_keeps_its_adapter_through_another_commit(
    nats_url: str, fleet_name: str, make_stack: Callable[..., EmbeddedStack], tmp_path: Path
) -> None:
    """The leader that committed ``policy`` from the store died the moment its
    commit point landed (before its answer and its clean-up); a successor
    finishes the commit. Another adapter's commit then sweeps the store
    (orphan age 0): ``policy``'s object stays, and nodes that start with an
    empty cache fetch it for a new version with the same bytes."""
    subjects = Subjects(fleet=fleet_name)
    nc = await connect(nats_url, name="test-predecessor")
    try:
        store = await FleetStore.open(nc, _config(fleet_name))  # provisions the fleet
        policy, _ = await push_adapter(nc, subjects, _write_adapter(tmp_path / "p", b"p" * 4096))
        await leave_a_claimed_commit(store, _committed(1, policy, []), MEMBERS)
    finally:
        await close(nc)

    caches = tmp_path / "caches"
    async with make_stack(
        list(MEMBERS.values()), orphan_after_s=0.0, cache_root=str(caches)
    ) as stack:
        assert stack.client is not None
        finished = await stack.client.update(
            "policy", digest=policy, version=1, update_id="policy-1"
        )
        orphan = await stack.client.push_adapter(_write_adapter(tmp_path / "x", b"x" * 4096))
        other = await stack.client.update(
            "other", source=_write_adapter(tmp_path / "o", b"o" * 4096), version=1
        )
        async with asyncio.timeout(30):  # the sweep runs after the answer
            while await object_size(stack.client.nc, subjects, orphan) is not None:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        still = await object_size(stack.client.nc, subjects, policy)
        shutil.rmtree(caches)  # every node starts with an empty cache
        again = await stack.client.update("policy", digest=policy, version=2)

    assert finished.committed and finished.digest == policy, finished
    assert other.committed, other
    assert still is not None, "the committed adapter was deleted"
    assert again.committed and again.digest == policy, again.error


async def _stored_digests(stack: EmbeddedStack, subjects: Subjects) -> set[str]:
    assert stack.client is not None
    objects = AdapterStore(stack.client.nc, subjects)
    return set((await objects.contents())[""].objects)


async def test_only_what_nothing_names_and_is_old_is_swept(
    nats_url: str, fleet_name: str, make_stack: Callable[..., EmbeddedStack], tmp_path: Path
) -> None:
    """The sweep spares the committed version and those kept beside it, what a
    queued request names, and whatever is younger than the orphan
    age (a trainer pushes, then asks); it removes old objects nothing names,
    a meta record of no pushed adapter and the chunks of a push that stopped."""
    subjects = Subjects(fleet=fleet_name)
    bucket = subjects.adapter_store()
    async with make_stack([1], keep=2) as stack:
        assert stack.client is not None
        adapters = [_write_adapter(tmp_path / f"a{n}", bytes([n]) * 4096) for n in range(4)]
        kept, committed, waiting, orphan = [await stack.client.push_adapter(a) for a in adapters]
        for version, digest in ((1, kept), (2, committed)):
            result = await stack.client.update("policy", digest=digest, version=version)
            assert result.committed, result.error
        js = stack.client.nc.jetstream()
        await js.publish(f"$O.{bucket}.M.bm90ZXM=", json.dumps({"name": "notes"}).encode())
        await js.publish(f"$O.{bucket}.C.{'ab' * 32}.stopped.0", b"half a push")

        nc = await connect(nats_url, name="test-sweeper")
        try:
            objects = AdapterStore(nc, subjects, orphan_after_s=3600.0)
            records = await FleetStore.open(nc, _config(fleet_name))

            async def sweep(after_s: float) -> list[str]:
                return await delete_unkept(
                    records,
                    objects,
                    dropped=[],
                    in_use=lambda: {waiting},
                    leading=_leading,
                    sweep=True,
                    wall_now=time.time() + after_s,
                )

            young = await sweep(0.0)
            old = await sweep(7200.0)
            left = await _stored_digests(stack, subjects)
            info = await js.stream_info(f"OBJ_{bucket}", subjects_filter=f"$O.{bucket}.>")
        finally:
            await close(nc)

    assert young == []
    stopped = f"chunks {'ab' * 32}.stopped"
    assert sorted(old) == sorted([orphan, f"$O.{bucket}.M.bm90ZXM=", stopped])
    assert left == {kept, committed, waiting}
    assert not any("stopped" in s or "bm90ZXM" in s for s in info.state.subjects or {})


async def test_nothing_is_deleted_when_a_record_cannot_be_read(
    nats_url: str, fleet_name: str, make_stack: Callable[..., EmbeddedStack], tmp_path: Path
) -> None:
    """A commit point that does not decode could name any digest: the
    deletion stops, saying so, and deletes nothing."""
    subjects = Subjects(fleet=fleet_name)
    async with make_stack([1]) as stack:
        assert stack.client is not None
        orphan = await stack.client.push_adapter(_write_adapter(tmp_path / "a", b"a" * 4096))
        nc = await connect(nats_url, name="test-sweeper")
        try:
            kv = await nc.jetstream().key_value(subjects.state_bucket())
            await kv.put("committed.garbled", b"\xff not a record")
            records = await FleetStore.open(nc, _config(fleet_name))
            objects = AdapterStore(nc, subjects, orphan_after_s=0.0)
            with pytest.raises(CorruptRecord, match=r"committed\.garbled"):
                await delete_unkept(
                    records,
                    objects,
                    dropped=[orphan],
                    in_use=set,
                    leading=_leading,
                    sweep=True,
                    wall_now=time.time() + 7200,
                )
            size = await object_size(nc, subjects, orphan)
        finally:
            await close(nc)

    assert size is not None, "nothing may be deleted on a guess"


async def test_an_object_admission_is_looking_for_is_not_deleted_under_it(
    nats_url: str,
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request whose object admission is looking for joins the queue as
    soon as the look ends: a deletion meanwhile spares it. One that comes
    while the object is being deleted is refused, as not stored."""
    subjects = Subjects(fleet=fleet_name)
    async with make_stack([1]) as stack:
        assert stack.client is not None
        digest = await stack.client.push_adapter(_write_adapter(tmp_path / "a", b"a" * 4096))
        nc = await connect(nats_url, name="test-admission")
        try:
            records = await FleetStore.open(nc, _config(fleet_name))
            objects = AdapterStore(nc, subjects)
            looking, go_on = asyncio.Event(), asyncio.Event()
            real_size = adapter_store.object_size

            async def slow_look(*args: object, **kwargs: object) -> int | None:
                looking.set()
                await go_on.wait()
                return await real_size(*args, **kwargs)  # type: ignore[arg-type]

            monkeypatch.setattr(adapter_store, "object_size", slow_look)
            admitting = asyncio.ensure_future(objects.check_stored(digest))
            await looking.wait()
            spared = await delete_unkept(
                records,
                objects,
                dropped=[digest],
                in_use=set,
                leading=_leading,
                sweep=False,
                wall_now=time.time(),
            )
            go_on.set()
            await admitting  # stored: it would join the queue now

            monkeypatch.setattr(adapter_store, "object_size", real_size)
            deleting = asyncio.ensure_future(objects.delete(digest))
            await asyncio.sleep(0)  # it starts, and waits on the store
            with pytest.raises(BadRequest, match="is being deleted"):
                await objects.check_stored(digest)
            assert await deleting is True
        finally:
            await close(nc)

    assert spared == []


def test_a_commit_point_of_wire_version_6_still_keeps_its_stored_versions() -> None:
    """Version 6 kept only the object store's versions, by digest: such a
    record decodes, and what it kept stays in the store (engines are not
    asked to serve it: it has no served name)."""
    old = msgspec.json.encode(
        {
            "adapter": "policy",
            "version": 2,
            "path": bus_path(D[1]),
            "served_name": "policy-v2",
            "rank_map": msgspec.to_builtins(build_rank_map(MEMBERS)),
            "kept": [{"version": 1, "digest": D[0]}],
        }
    )
    record = msgspec.json.decode(old, type=CommittedRecord)

    assert record.kept == [KeptVersion(version=1, digest=D[0])]
    assert set(keepers({"policy": record}, {})) == {D[0], D[1]}
