"""Admission looks up what a request needs from outside the book (among it,
the object the request names in the fleet's store) as the request arrives,
at once with other requests' look-ups, so that look-ups never add up; the
requests of one adapter still join the book in the order they arrived, and
another adapter's go by. The object a
request names is spared by the leader's deletions from its look until the
request has joined the book or been refused, however long it waits for its
turn.

The real agent and the real coordinator run on the in-memory bus
(``memory_fleet.py``) under looptime's fake clock. The object store's
look-up is replaced by one a test holds (the store itself, on a real
nats-server, is ``test_adapter_store_keeps.py``'s), and so are its deletions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from memory_fleet import InMemoryFleet

from lorabus.coordinator import adapter_store, service
from lorabus.coordinator.adapter_store import AdapterStore, delete_unkept
from lorabus.coordinator.term import Term
from lorabus.schemas import CommittedRecord, ErrorCode, InflightRecord, ResetRecord, Subjects
from lorabus.schemas import UpdateResult as Result

pytestmark = pytest.mark.looptime

X, Y, Z = ("sha256:" + c * 64 for c in "abc")
LOOK_S = 1.0
"""How long an unheld look-up takes, on the fake clock."""
DEADLINE_S = 30.0


class _Store:
    """The fleet's object store as admission's look-up and the leader's
    deletions see it: what is stored, every look (started, ended, when),
    looks held until a test lets them go, and what was deleted."""

    def __init__(self, stored: set[str]) -> None:
        self.stored = stored
        self.held: dict[str, asyncio.Event] = {}
        self.looks: list[tuple[str, str, float]] = []
        self.deleted: list[str] = []

    async def object_size(self, nc: Any, subjects: Any, digest: str, **_: Any) -> int | None:
        loop = asyncio.get_running_loop()
        self.looks.append(("started", digest, loop.time()))
        held = self.held.get(digest)
        if held is not None:
            await held.wait()
        else:
            await asyncio.sleep(LOOK_S)
        self.looks.append(("ended", digest, loop.time()))
        return 4096 if digest in self.stored else None

    async def delete_object(self, nc: Any, subjects: Any, digest: str) -> bool:
        self.deleted.append(digest)
        self.stored.discard(digest)
        return True

    def hold(self, digest: str) -> asyncio.Event:
        release = self.held[digest] = asyncio.Event()
        return release

    async def wait_look(self, what: str, digest: str) -> None:
        async with asyncio.timeout(DEADLINE_S):
            while not any(w == what and d == digest for w, d, _ in self.looks):  # noqa: ASYNC110
                await asyncio.sleep(0.01)


class _NoRecords:
    """A state bucket that keeps nothing: only the requests can spare a digest."""

    async def read_adapter_records(
        self,
    ) -> tuple[dict[str, CommittedRecord], dict[str, ResetRecord]]:
        return {}, {}

    async def read_inflights(self) -> list[InflightRecord]:
        return []


async def _leading() -> bool:
    return True


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> _Store:
    fake = _Store(stored={Y, Z})
    monkeypatch.setattr(adapter_store, "object_size", fake.object_size)
    monkeypatch.setattr(adapter_store, "delete_object", fake.delete_object)
    return fake


@pytest.fixture
def terms(monkeypatch: pytest.MonkeyPatch) -> list[Term]:
    """Every term the coordinator starts, as it starts it (ask for it before
    the fleet)."""
    started: list[Term] = []

    class Recorded(Term):
        def __init__(self, **parts: Any) -> None:
            super().__init__(**parts)
            started.append(self)

    monkeypatch.setattr(service, "Term", Recorded)
    return started


@pytest.fixture
async def fleet() -> AsyncIterator[InMemoryFleet]:
    async with InMemoryFleet({"w0": 1}) as running:
        yield running


@contextlib.asynccontextmanager
async def _asking(ask: Awaitable[Result]) -> AsyncIterator[asyncio.Task[Result]]:
    """``ask`` as a task of the test's, cancelled and awaited at the end."""
    task = asyncio.ensure_future(ask)
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _answered_at(task: asyncio.Task[Result]) -> Callable[[], float | None]:
    """When ``task`` was answered (the fake clock), once it was."""
    at: list[float] = []
    task.add_done_callback(lambda _: at.append(asyncio.get_running_loop().time()))
    return lambda: at[0] if at else None


async def test_a_slow_look_up_adds_nothing_to_the_requests_behind_it_which_join_in_order(
    fleet: InMemoryFleet, store: _Store
) -> None:
    """A's look-up hangs; B, which came after it with the same update id
    and other content, has its own look-up meanwhile, and waits for A to
    join the book: once A's ends, both are answered at once, B as the
    repeat of an id that A, having come first, holds."""
    release_x = store.hold(X)
    loop = asyncio.get_running_loop()
    first = fleet.client().update("policy", digest=X, version=1, update_id="u1")
    async with _asking(first) as a:
        await store.wait_look("started", X)
        second = fleet.client().update("policy", digest=Y, version=1, update_id="u1")
        async with _asking(second) as b:
            b_answered = _answered_at(b)
            await store.wait_look("ended", Y)
            waited = not a.done() and not b.done()
            released_at = loop.time()
            release_x.set()
            a_result, b_result = await asyncio.wait_for(asyncio.gather(a, b), DEADLINE_S)

    assert waited, "B joined the book before A, which arrived first"
    assert a_result.error is not None and a_result.error.code == ErrorCode.BAD_REQUEST
    assert "is not in the fleet's object store" in a_result.error.message
    assert b_result.error is not None and b_result.error.code == ErrorCode.BAD_REQUEST
    assert f"was first used for 'policy' version 1 from bus:{X}" in b_result.error.message
    # B's look ran while A's hung: after A's ended it waited for no look of its own.
    answered = b_answered()
    assert answered is not None and answered - released_at < LOOK_S


async def test_a_slow_look_up_holds_no_request_of_another_adapter(
    fleet: InMemoryFleet, store: _Store
) -> None:
    """A's look-up hangs; B, for another adapter, came after it and is
    answered meanwhile: only the requests of A's adapter wait for its turn."""
    release_x = store.hold(X)
    async with _asking(fleet.client().update("policy", digest=X, version=1)) as a:
        await store.wait_look("started", X)
        async with _asking(fleet.client().update("other", digest=Y, version=1)) as b:
            b_result = await asyncio.wait_for(b, DEADLINE_S)
            a_waiting = not a.done()
            release_x.set()
            a_result = await asyncio.wait_for(a, DEADLINE_S)

    assert a_waiting, "A's look-up was let go before B was answered"
    assert b_result.update_id and b_result.status in ("committed", "failed"), b_result
    assert (
        a_result.error is not None and "not in the fleet's object store" in a_result.error.message
    )


async def test_the_object_of_a_request_waiting_for_its_turn_is_not_deleted(
    terms: list[Term], store: _Store, fleet: InMemoryFleet
) -> None:
    """B's look found its object while A, ahead of it, still looks: until B
    joins the book (whose queue then keeps it), a deletion spares B's
    object; an object nothing names goes."""
    [term] = terms
    release_x = store.hold(X)

    async def delete(dropped: list[str]) -> list[str]:
        return await delete_unkept(
            _NoRecords(),  # type: ignore[arg-type]
            term.adapters,
            dropped=dropped,
            in_use=lambda: {p.removeprefix("bus:") for p in term.book.held_paths()},
            leading=_leading,
            sweep=False,
            wall_now=time.time(),
        )

    async with _asking(fleet.client().update("policy", digest=X, version=1)) as a:
        await store.wait_look("started", X)
        async with _asking(fleet.client().update("policy", digest=Y, version=2, update_id="b")):
            await store.wait_look("ended", Y)
            not_joined = not term.book.knows("b")
            while_waiting = await delete([Y, Z])
            release_x.set()
            refused = await asyncio.wait_for(a, DEADLINE_S)
            async with asyncio.timeout(DEADLINE_S):
                while not term.book.knows("b"):  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            once_joined = await delete([Y])

    assert not_joined, "B joined before A, which arrived first"
    assert while_waiting == [Z], "the object of a request on its way into the queue went"
    assert once_joined == []
    assert store.deleted == [Z]
    assert refused.error is not None and refused.error.code == ErrorCode.BAD_REQUEST


async def test_a_request_that_comes_while_a_deletion_asks_whether_it_leads_is_spared(
    store: _Store,
) -> None:
    """A deletion asks the store whether its term still leads right before it
    deletes: a request for the object that comes meanwhile spares it."""
    objects = AdapterStore(None, Subjects(fleet="f"))  # type: ignore[arg-type]
    with contextlib.ExitStack() as admitting:

        async def leading() -> bool:
            admitting.enter_context(objects.admitting(Y))  # a request comes for Y
            return True

        deleted = await delete_unkept(
            _NoRecords(),  # type: ignore[arg-type]
            objects,
            dropped=[Y],
            in_use=set,
            leading=leading,
            sweep=False,
            wall_now=time.time(),
        )

    assert deleted == [] and store.deleted == []
