"""Adapters that travel over the bus: pushed once to the fleet's object store,
fetched by each agent into a cache of its own (as on separate nodes, with no
filesystem shared with the trainer), before any engine is paused. A real
nats-server, the real coordinator and agents, a simulated Dynamo fleet."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from lorabus.adapters.bus_paths import digest_of
from lorabus.adapters.digest import adapter_digest
from lorabus.adapters.store import object_size
from lorabus.bus.connect import close, connect
from lorabus.schemas import (
    ErrorCode,
    PauseCommand,
    Phase,
    PrepareCommand,
    Subjects,
    ack_decoder,
    command_decoder,
)
from lorabus.security.roles import Role
from lorabus.testbed.stack import EmbeddedStack

UNKNOWN = "sha256:" + "0" * 64


def _loaded_uris(stack: EmbeddedStack) -> dict[str, list[str]]:
    """Each worker's load sources, as its engine was handed them."""
    assert stack.sim is not None
    return {
        wid: [
            r.body["source"]["uri"]
            for r in worker.requests
            if r.method == "POST" and isinstance(r.body, dict) and "source" in r.body
        ]
        for wid, worker in stack.sim.workers.items()
    }


def _pauses(stack: EmbeddedStack) -> int:
    assert stack.sim is not None
    return sum(
        w.count_requests("POST", "/engine/pause_generation") for w in stack.sim.workers.values()
    )


async def _stored_messages(nats_url: str, fleet: str) -> int:
    nc = await connect(nats_url, name="test-store-reader")
    try:
        info = await nc.jetstream().stream_info(f"OBJ_{Subjects(fleet=fleet).adapter_store()}")
        return info.state.messages
    finally:
        await close(nc)


async def test_each_agent_fetches_the_pushed_adapter_into_its_own_cache(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    tmp_path: Path,
) -> None:
    nodes = tmp_path / "nodes"
    async with make_stack([1, 2], cache_root=str(nodes)) as stack:
        assert stack.client is not None
        digest = await stack.client.push_adapter(make_adapter(1))
        result = await stack.client.update("policy", digest=digest, version=1, update_id="u1")
        uris = _loaded_uris(stack)

    assert result.committed, result.error
    assert result.digest == digest and result.path == f"bus:{digest}"
    assert Phase.PREPARE in result.phases
    for worker_id, loaded in uris.items():
        cached = nodes / worker_id / digest.removeprefix("sha256:")
        assert loaded == [cached.as_uri()], (worker_id, loaded)
        assert adapter_digest(cached) == digest


async def test_a_source_is_pushed_once_per_content_and_served_again_from_cache(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    nats_url: str,
    fleet_name: str,
) -> None:
    """The same bytes as two versions (a step that changed nothing): the
    second push sends nothing and the second fetch reads the cache."""
    source = make_adapter(1)
    async with make_stack([1, 1]) as stack:
        assert stack.client is not None
        first = await stack.client.update("policy", source=source, version=1)
        stored = await _stored_messages(nats_url, fleet_name)
        second = await stack.client.update("policy", source=source, version=2)
        stored_after = await _stored_messages(nats_url, fleet_name)

    assert first.committed and second.committed, (first.error, second.error)
    assert first.digest == second.digest == adapter_digest(source)
    assert stored_after == stored, "the same content was uploaded twice"


async def test_an_unknown_digest_is_refused_before_anything_pauses(
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 1]) as stack:
        assert stack.client is not None
        result = await stack.client.update("policy", digest=UNKNOWN, version=1, timeout_s=30)
        pauses = _pauses(stack)

    assert result.error is not None and result.error.code == ErrorCode.BAD_REQUEST, result
    assert UNKNOWN in result.error.message and "lorabus adapter push" in result.error.message
    assert pauses == 0


async def test_every_member_has_fetched_before_any_engine_is_paused(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    nats_url: str,
    fleet_name: str,
) -> None:
    """What one connection hears, in order: the prepare, every member's ack of
    it, and only then a pause."""
    subjects = Subjects(fleet=fleet_name)
    heard: list[str] = []
    nc = await connect(nats_url, name="test-listener")
    try:

        async def on_command(msg: object) -> None:
            command = command_decoder.decode(msg.data)  # type: ignore[attr-defined]
            if isinstance(command, PrepareCommand | PauseCommand):
                heard.append(type(command).__name__)

        async def on_ack(msg: object) -> None:
            ack = ack_decoder.decode(msg.data)  # type: ignore[attr-defined]
            if ack.phase is Phase.PREPARE and ack.ok:
                heard.append(f"prepared {ack.worker_id}")

        await nc.subscribe(f"{subjects.cmd()}.>", cb=on_command)
        await nc.subscribe(subjects.cmd(), cb=on_command)
        await nc.subscribe(subjects.ack_any(), cb=on_ack)
        await nc.flush()
        async with make_stack([1, 1, 1]) as stack:
            assert stack.client is not None
            result = await stack.client.update("policy", source=make_adapter(1), version=1)
        await nc.flush()
    finally:
        await close(nc)

    assert result.committed, result.error
    first_pause = heard.index("PauseCommand")
    prepared = {h for h in heard[:first_pause] if h.startswith("prepared ")}
    assert prepared == {"prepared w000", "prepared w001", "prepared w002"}, heard


async def test_an_object_that_is_not_what_its_name_says_is_never_served(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    nats_url: str,
    fleet_name: str,
) -> None:
    """Someone who may write the store points the object of one digest at the
    bytes of another adapter. Every member refuses it while fetching: the
    update fails with ``fetch_failed`` or ``digest_mismatch`` naming each of
    them, and no engine was paused or loaded anything."""
    async with make_stack([1, 1]) as stack:
        assert stack.client is not None
        wanted = await stack.client.push_adapter(make_adapter(1))
        other = await stack.client.push_adapter(make_adapter(2))
        await _point(nats_url, fleet_name, wanted, at=other)
        result = await stack.client.update("policy", digest=wanted, version=1, timeout_s=60)
        pauses, uris = _pauses(stack), _loaded_uris(stack)

    assert result.status == "failed" and result.error is not None, result
    failed = {wid: w.error for wid, w in result.workers.items() if w.error is not None}
    assert set(failed) == {"w000", "w001"}, result.workers
    for error in failed.values():
        assert error.code in (ErrorCode.FETCH_FAILED, ErrorCode.DIGEST_MISMATCH), error
    assert pauses == 0
    assert all(loaded == [] for loaded in uris.values()), uris


async def _point(nats_url: str, fleet: str, digest: str, *, at: str) -> None:
    """Rewrite the meta record of ``digest`` to name the chunks of ``at``."""
    bucket = Subjects(fleet=fleet).adapter_store()
    stream = f"OBJ_{bucket}"

    def meta_subject(name: str) -> str:
        return f"$O.{bucket}.M.{base64.urlsafe_b64encode(name.encode()).decode()}"

    nc = await connect(nats_url, name="test-forger")
    try:
        js = nc.jetstream()
        theirs = json.loads((await js.get_last_msg(stream, meta_subject(at))).data)
        ours = json.loads((await js.get_last_msg(stream, meta_subject(digest))).data)
        forged = {**theirs, "name": ours["name"]}
        # Written once: only a purge (the leader's right) lets another meta in.
        await js.purge_stream(stream, subject=meta_subject(digest))
        await js.publish(meta_subject(digest), json.dumps(forged).encode())
    finally:
        await close(nc)


@pytest.mark.parametrize("asked", ["nothing", "both"])
async def test_a_request_names_one_source(
    make_adapter: Callable[[int], str], make_stack: Callable[..., EmbeddedStack], asked: str
) -> None:
    """Neither a path nor anything from the store, or both at once, is a
    mistake the client says at once, before anything is sent."""
    from lorabus.errors import BadRequest

    async with make_stack([1]) as stack:
        assert stack.client is not None
        with pytest.raises(BadRequest):
            if asked == "nothing":
                await stack.client.update("policy", version=1)
            else:
                await stack.client.update(
                    "policy", make_adapter(1), source=make_adapter(2), version=1
                )


@pytest.mark.parametrize("secure", [False, True], ids=["open", "with roles"])
async def test_the_leader_deletes_the_objects_no_adapter_keeps(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    fleet_name: str,
    secure: bool,
) -> None:
    """Each adapter keeps the objects of its ``keep`` newest commits, as its
    engines keep its versions; an object another adapter still keeps stays.
    With roles, the coordinator's own permissions suffice."""
    subjects = Subjects(fleet=fleet_name)
    started = (
        EmbeddedStack([1], fleet=fleet_name, secure=True, heartbeat_s=0.2, keep=2)
        if secure
        else make_stack([1], keep=2)
    )
    async with started as stack:
        assert stack.client is not None
        digests = [await stack.client.push_adapter(make_adapter(step)) for step in (1, 2, 3, 4)]
        shared = await stack.client.update("other", digest=digests[0], version=1)
        results = [
            await stack.client.update("policy", digest=digest, version=version)
            for version, digest in enumerate(digests, start=1)
        ]
        nc = await stack.bus_as(Role.ORCHESTRATOR).connect("test-store-reader")
        try:
            # The leader deletes after its answer and its notice.
            async with asyncio.timeout(30):
                while await object_size(nc, subjects, digests[1]) is not None:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            sizes = [await object_size(nc, subjects, digest) for digest in digests]
        finally:
            await close(nc)

    assert shared.committed and all(r.committed for r in results), results
    stored = [size is not None for size in sizes]
    # policy keeps v3 and v4; v1's object is "other"'s committed one.
    assert stored == [True, False, True, True], stored


@pytest.mark.parametrize("secure", [False, True], ids=["open", "with roles"])
async def test_an_object_pushed_but_never_committed_is_deleted_at_a_later_commit(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    fleet_name: str,
    secure: bool,
) -> None:
    """An update that failed (or was never asked) leaves its object behind:
    past the coordinator's orphan age (0 here), the next commit from the
    store deletes it, and keeps what it committed. With roles, the
    coordinator's own permissions suffice to list the store."""
    subjects = Subjects(fleet=fleet_name)
    started = (
        EmbeddedStack([1], fleet=fleet_name, secure=True, heartbeat_s=0.2, orphan_after_s=0.0)
        if secure
        else make_stack([1], orphan_after_s=0.0)
    )
    async with started as stack:
        assert stack.client is not None
        never_asked = await stack.client.push_adapter(make_adapter(1))
        result = await stack.client.update("policy", source=make_adapter(2), version=2)
        nc = await stack.bus_as(Role.ORCHESTRATOR).connect("test-store-reader")
        try:
            # The leader deletes after its answer and its notice.
            async with asyncio.timeout(30):
                while await object_size(nc, subjects, never_asked) is not None:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            committed = await object_size(nc, subjects, digest_of(result.path) or "")
        finally:
            await close(nc)

    assert result.committed, result
    assert committed is not None, "the committed object stays"


async def test_an_engine_that_lost_the_committed_adapter_gets_it_from_the_store_again(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
    tmp_path: Path,
) -> None:
    """Its engine restarted and its node's cache is gone (a new node): the
    agent fetches the committed adapter from the store and reloads it, with
    no directory anywhere but in the store."""
    nodes = tmp_path / "nodes"
    async with make_stack([1, 1], cache_root=str(nodes)) as stack:
        assert stack.client is not None and stack.sim is not None
        source = make_adapter(1)
        result = await stack.client.update("policy", source=source, version=1)
        shutil.rmtree(source)
        shutil.rmtree(nodes / "w001")
        worker = stack.sim.workers["w001"]
        worker.remove_adapter("policy-v1")  # as an engine restart would
        await asyncio.wait_for(worker.wait_until(lambda: "policy-v1" in worker.adapters), 30)

    assert result.committed, result.error
    assert result.digest is not None
    assert adapter_digest(nodes / "w001" / result.digest.removeprefix("sha256:")) == result.digest
