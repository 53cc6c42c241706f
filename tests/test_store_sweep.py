"""What the leader's deletions must survive: garbage an orchestrator may
publish on the store's subjects, a read that fails for a moment, a store
full of orphans with no commit to come, a predecessor's queue it cannot
know, and losing its lease. Each deletes nothing it must keep and ends no
term.

A real nats-server, the real coordinator and agents where a fleet is
needed; the store's own functions otherwise.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import nats.js.errors
import pytest
from adapter_dirs import write_adapter
from nats.aio.client import Client as NatsClient
from store_helpers import leave_a_claimed_commit

from lorabus.adapters import store as adapter_objects
from lorabus.adapters import store_layout
from lorabus.adapters.bus_paths import bus_path
from lorabus.adapters.digest import adapter_digest
from lorabus.adapters.fetch import fetch_object
from lorabus.adapters.store import object_size, push_adapter
from lorabus.bus.connect import close, connect
from lorabus.coordinator.adapter_store import AdapterStore, delete_unkept
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.store import FleetStore
from lorabus.errors import BusError
from lorabus.schemas import CommittedRecord, Subjects, build_rank_map
from lorabus.testbed.stack import EmbeddedStack

MEMBERS = {"w000": 1}


def _write_adapter(root: Path, weights: bytes) -> str:
    return str(write_adapter(root, weights))


def _meta_subject(subjects: Subjects, digest: str) -> str:
    name = base64.urlsafe_b64encode(digest.encode()).decode()
    return f"$O.{subjects.adapter_store()}.M.{name}"


async def _leading() -> bool:
    return True


async def _deposed() -> bool:
    return False


@pytest.fixture
def subjects(fleet_name: str) -> Subjects:
    return Subjects(fleet=fleet_name)


@pytest.fixture
async def parts(
    nats_url: str, fleet_name: str, subjects: Subjects
) -> AsyncIterator[tuple[NatsClient, FleetStore]]:
    """A connection to a provisioned fleet, and its state bucket."""
    nc = await connect(nats_url, name="test-sweep")
    config = CoordinatorConfig(
        fleet=fleet_name, frontend_url="http://frontend.invalid", expected_world_size=1
    )
    try:
        yield nc, await FleetStore.open(nc, config)
    finally:
        await close(nc)


async def _sweep(
    records: FleetStore,
    objects: AdapterStore,
    *,
    dropped: list[str] | None = None,
    leading: Callable[[], object] = _leading,
    in_use: Callable[[], set[str]] = set,
) -> list[str]:
    """A sweep at a moment when everything is older than the orphan age."""
    return await delete_unkept(
        records,
        objects,
        dropped=dropped or [],
        in_use=in_use,
        leading=leading,  # type: ignore[arg-type]
        sweep=True,
        wall_now=time.time() + 10 * 86400,
    )


async def test_garbage_on_the_chunk_subjects_is_swept_and_ends_nothing(
    parts: tuple[NatsClient, FleetStore], subjects: Subjects
) -> None:
    """Any tokens the stream takes are swept like a stopped push; a subject
    of another shape is not even stored."""
    nc, records = parts
    bucket = subjects.adapter_store()
    js = nc.jetstream()
    await js.publish(f"$O.{bucket}.C.x-y.z_w.0", b"garbage")
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await js.publish(f"$O.{bucket}.C.x-y.0", b"no stream takes it")

    deleted = await _sweep(records, AdapterStore(nc, subjects, orphan_after_s=0.0))

    assert deleted == ["chunks x-y.z_w"]
    assert (await js.stream_info(f"OBJ_{bucket}")).state.messages == 0


async def test_a_store_read_that_fails_deletes_nothing(
    parts: tuple[NatsClient, FleetStore],
    subjects: Subjects,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A meta record no replica answers for (a node restarting) is not taken
    for a stray one: the store is not swept this time (the others would be),
    and the object and its chunks stay."""
    nc, records = parts
    digest, _ = await push_adapter(nc, subjects, _write_adapter(tmp_path / "a", b"a" * 4096))
    real_get = store_layout._direct_get

    async def silent_for_the_meta(n: NatsClient, s: Subjects, suffix: str, body: bytes) -> object:
        if suffix == f".{_meta_subject(subjects, digest)}":
            raise BusError("no replica of the store answered")
        return await real_get(n, s, suffix, body)

    monkeypatch.setattr(store_layout, "_direct_get", silent_for_the_meta)
    assert await _sweep(records, AdapterStore(nc, subjects, orphan_after_s=0.0)) == []
    monkeypatch.setattr(store_layout, "_direct_get", real_get)

    assert await fetch_object(nc, subjects, digest, io.BytesIO(), timeout_s=10, max_bytes=1 << 20)


async def test_a_meta_naming_another_objects_chunks_takes_none_of_them(
    parts: tuple[NatsClient, FleetStore], subjects: Subjects, tmp_path: Path
) -> None:
    """An orchestrator stores a meta record for a digest nobody pushed that
    names a kept object's nuid: deleting that forgery purges nothing of the
    kept object, whose chunks live under its own digest."""
    nc, records = parts
    kept, _ = await push_adapter(nc, subjects, _write_adapter(tmp_path / "k", b"k" * 4096))
    js = nc.jetstream()
    meta = json.loads(
        (
            await js.get_last_msg(f"OBJ_{subjects.adapter_store()}", _meta_subject(subjects, kept))
        ).data
    )
    forged = "sha256:" + "f" * 64
    await js.publish(_meta_subject(subjects, forged), json.dumps({**meta, "name": forged}).encode())

    deleted = await _sweep(
        records, AdapterStore(nc, subjects, orphan_after_s=0.0), in_use=lambda: {kept}
    )

    assert deleted == [forged]
    into = io.BytesIO()
    await fetch_object(nc, subjects, kept, into, timeout_s=10, max_bytes=1 << 20)
    assert into.tell() == meta["size"]


async def test_a_deposed_leader_deletes_nothing(
    parts: tuple[NatsClient, FleetStore], subjects: Subjects, tmp_path: Path
) -> None:
    nc, records = parts
    orphan, _ = await push_adapter(nc, subjects, _write_adapter(tmp_path / "o", b"o" * 4096))

    with pytest.raises(BusError, match="no longer leading"):
        await _sweep(
            records,
            AdapterStore(nc, subjects, orphan_after_s=0.0),
            dropped=[orphan],
            leading=_deposed,
        )

    assert await object_size(nc, subjects, orphan) is not None


async def test_a_chunk_subject_taken_before_the_push_fails_it_saying_so(
    parts: tuple[NatsClient, FleetStore],
    subjects: Subjects,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nuids are random, so only a guess takes one; if one did, the push
    says so and stores nothing under its digest."""
    nc, _ = parts
    directory = _write_adapter(tmp_path / "a", b"a" * 4096)
    digest = adapter_digest(directory)
    monkeypatch.setattr(adapter_objects.secrets, "token_hex", lambda n: "guessed")
    hex_digest = digest.removeprefix("sha256:")
    await nc.jetstream().publish(
        f"$O.{subjects.adapter_store()}.C.{hex_digest}.guessed.0", b"first"
    )

    with pytest.raises(BusError, match="stored already, by another hand"):
        await push_adapter(nc, subjects, directory)

    assert await object_size(nc, subjects, digest) is None


async def test_a_store_full_of_orphans_is_swept_with_no_commit_to_come(
    make_stack: Callable[..., EmbeddedStack], tmp_path: Path
) -> None:
    """Pushes nobody asks for fill the store; no update can commit (its push
    is refused), yet the leader's sweep runs on its own and makes room."""
    async with make_stack([1], orphan_after_s=1.0, adapter_store_max_bytes=2 << 20) as stack:
        assert stack.client is not None
        refused = None
        for n in range(8):  # 600 kB each: full within four
            try:
                await stack.client.push_adapter(
                    _write_adapter(tmp_path / f"o{n}", bytes([n]) * 600_000)
                )
            except BusError as exc:
                refused = exc
                break
        assert refused is not None and "is full" in str(refused)
        wanted = _write_adapter(tmp_path / "wanted", b"w" * 600_000)
        async with asyncio.timeout(60):  # only to fail instead of hanging
            while True:
                try:
                    digest = await stack.client.push_adapter(wanted)
                    break
                except BusError as exc:
                    assert "is full" in str(exc), exc
                    await asyncio.sleep(0.2)
        result = await stack.client.update("policy", digest=digest, version=1, timeout_s=30)

    assert result.committed, result.error


async def test_a_successor_leaves_what_a_recovered_commit_dropped_to_its_first_sweep(
    nats_url: str,
    fleet_name: str,
    subjects: Subjects,
    make_stack: Callable[..., EmbeddedStack],
    tmp_path: Path,
) -> None:
    """The leader that committed v2 (dropping v1's object) died before its
    clean-up; its queue may have held a request for v1's bytes, which its
    requester asks the successor again. The successor, finishing the commit,
    keeps v1's object until its first sweep, after the grace of a take-over."""
    nc = await connect(nats_url, name="test-predecessor")
    try:
        config = CoordinatorConfig(
            fleet=fleet_name, frontend_url="http://frontend.invalid", expected_world_size=1
        )
        store = await FleetStore.open(nc, config)
        v1, _ = await push_adapter(nc, subjects, _write_adapter(tmp_path / "v1", b"1" * 4096))
        v2, _ = await push_adapter(nc, subjects, _write_adapter(tmp_path / "v2", b"2" * 4096))
        committing = CommittedRecord(
            adapter="policy",
            version=2,
            path=bus_path(v2),
            served_name="policy-v2",
            rank_map=build_rank_map(MEMBERS),
            digest=v2,
            dropped=[v1],
        )
        await leave_a_claimed_commit(store, committing, MEMBERS)
    finally:
        await close(nc)

    async with make_stack([1], orphan_after_s=0.0, keep=1) as stack:
        assert stack.client is not None
        finished = await stack.client.update("policy", digest=v2, version=2, update_id="policy-2")
        # The old leader's queued request, asked again of its successor.
        again = await stack.client.update("policy", digest=v1, version=3)

    assert finished.committed, finished.error
    assert again.committed and again.digest == v1, again.error


async def test_each_tenants_store_is_swept_by_the_same_rule(
    nats_url: str, fleet_name: str, subjects: Subjects, tmp_path: Path
) -> None:
    """A tenant's store holds what its commits keep and loses its orphans,
    as the fleet's does; an object of one store keeps nothing of another;
    a store that cannot be listed stops no other's sweep."""
    tenants = tmp_path / "tenants.json"
    tenants.write_bytes(b'{"a": {"adapters": "a-*", "max_bytes": 16777216}}')
    nc = await connect(nats_url, name="test-sweep-tenants")
    config = CoordinatorConfig(
        fleet=fleet_name,
        frontend_url="http://frontend.invalid",
        expected_world_size=1,
        tenants_file=str(tenants),
    )
    try:
        records = await FleetStore.open(nc, config)  # provisions a's store too
        own = subjects.for_store("a")
        kept, _ = await push_adapter(nc, own, _write_adapter(tmp_path / "k", b"kept"))
        orphan, _ = await push_adapter(nc, own, _write_adapter(tmp_path / "o", b"orphan"))
        # The same bytes in the fleet's store: another object, kept by nothing.
        shared, _ = await push_adapter(nc, subjects, _write_adapter(tmp_path / "k2", b"kept"))
        assert shared == kept
        record = CommittedRecord(
            adapter="a-policy",
            version=1,
            path=bus_path(kept, "a"),
            served_name="a-policy-v1",
            rank_map=build_rank_map(MEMBERS),
        )
        await records.write_committed(record)

        # "ghost" is in no tenants file the server's streams were made from:
        # its store cannot be listed, and the others are swept all the same.
        objects = AdapterStore(nc, subjects, orphan_after_s=0.0, tenants=["a", "ghost"])
        deleted = await _sweep(records, objects)
        assert sorted(deleted) == sorted([f"a/{orphan}", kept]), deleted
        assert await object_size(nc, own, kept) is not None
        assert await object_size(nc, own, orphan) is None
        assert await object_size(nc, subjects, kept) is None
    finally:
        await close(nc)
