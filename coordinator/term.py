"""One term of leadership, and what the parts that serve it share.

A coordinator leads in terms, one at a time (``service.py``). A term has its
epoch, which every command, event and log line carries; its book (the queue,
the results, the committed state as this term knows it, ``book.py``); the
locks that run each adapter's updates and resets one at a time, and keep
deletions from the adapter store apart from the records' writes
(:class:`RecordsGate`); and the tasks that send
its replies (:class:`Replies`). Recovery, request admission, the update loop
and the commit (``recovery.py``, ``admission.py``, ``updates.py``,
``commit.py``, ``resets.py``) each receive the :class:`Term` rather than
share one class's attributes, and nothing of a term outlives it: at its end
its book is closed (everyone still waiting is answered ``not_leader``) and
its replies get a moment to go out, then are cancelled and awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

from lorabus.coordinator.adapter_store import AdapterStore
from lorabus.coordinator.book import book_of
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.membership import Membership
from lorabus.coordinator.metrics import CoordinatorMetrics
from lorabus.coordinator.ports import CommandBus
from lorabus.coordinator.reports import Reports
from lorabus.coordinator.signals import StoreUnavailable
from lorabus.coordinator.store import CorruptRecord, FleetStore
from lorabus.schemas import (
    CommittedRecord,
    ErrorCode,
    ErrorInfo,
    Subjects,
    UpdateFinished,
    UpdateResult,
)

log = logging.getLogger(__name__)

_ANSWERS_FIRST_S = 1.0
"""How long a finished update's notice waits for its answers to go out (a
reply is one publish; this bounds a connection that stalls)."""
_REPLIES_GRACE_S = 2.0
"""How long a term's last replies may take to go out once it ends."""


class RecordsGate:
    """Writes of the fleet's records, many at once, or one round of deletions
    from the adapter store alone. A deletion round decides what to delete
    from the records it reads (``adapter_store.py``): a commit that wrote its
    records and answered between that read and a deletion would lose what it
    keeps. Commits of different adapters write at once (each holds its own
    keys); a round waits for those under way, and those that come after it
    wait for it. Leaving never waits, so a cancelled holder cannot hang it."""

    def __init__(self) -> None:
        self._entry = asyncio.Lock()
        """Held by a deletion round, and for a moment by each writer to enter:
        FIFO, so a round waiting for it lets no later writer in before it."""
        self._writers = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        async with self._entry:
            self._writers += 1
            self._idle.clear()
        try:
            yield
        finally:
            self._writers -= 1
            if self._writers == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def deleting(self) -> AsyncIterator[None]:
        async with self._entry:
            await self._idle.wait()
            yield


class Replies:
    """The tasks that send a term's replies: started here, each owned until it
    ends; at the term's end given a moment to go out, then cancelled and
    awaited. Those that wait for an update's result say so
    (:meth:`answering`), so that what follows the answer waits for them."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._answering: dict[str, set[asyncio.Task[None]]] = {}

    def start(self, reply: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(reply)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @contextlib.contextmanager
    def answering(self, update_id: str) -> Iterator[None]:
        """The reply task running this is waiting to answer ``update_id``."""
        this = asyncio.current_task()
        answering = self._answering.setdefault(update_id, set())
        if this is not None:
            answering.add(this)
        try:
            yield
        finally:
            answering.discard(this)
            if not answering and self._answering.get(update_id) is answering:
                del self._answering[update_id]

    async def sent(self, update_id: str) -> None:
        """Until the answers to a just-finished update have been sent (bounded)."""
        answering = self._answering.get(update_id)
        if answering:
            await asyncio.wait(set(answering), timeout=_ANSWERS_FIRST_S)

    async def close(self) -> None:
        """Let pending replies go out, then cancel and await whatever is left."""
        if not self._tasks:
            return
        _, late = await asyncio.wait(set(self._tasks), timeout=_REPLIES_GRACE_S)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)


class Term:
    """One term: its epoch, and what the parts that serve it share."""

    def __init__(
        self,
        *,
        epoch: int,
        holder: str,
        config: CoordinatorConfig,
        store: FleetStore,
        bus: CommandBus,
        membership: Membership,
        metrics: CoordinatorMetrics,
        reports: Reports,
        leading: asyncio.Event,
        max_payload: Callable[[], int],
        adapters: AdapterStore,
    ) -> None:
        self.epoch = epoch
        self.holder = holder
        self.config = config
        self.subjects = Subjects(fleet=config.fleet, prefix=config.subject_prefix)
        self.store = store
        self.bus = bus
        self.membership = membership
        self.metrics = metrics
        self.reports = reports
        self.leading = leading
        """Set while this term serves requests (after its recovery)."""
        self.max_payload = max_payload
        """The largest message the bus carries (the server's, once connected)."""
        self.adapters = adapters
        """The fleet's object store of adapters (``bus:`` paths)."""
        adapters.took_office(successor=epoch > 1)
        self.book = book_of(config)
        self.records = RecordsGate()
        """Commits and resets write the records through it, deletions from
        the adapter store (a commit's retired objects, the sweep) go alone."""
        self._adapter_turns: dict[str, tuple[asyncio.Lock, int]] = {}
        self.replies = Replies()

    @contextlib.asynccontextmanager
    async def adapter_turn(self, adapter: str) -> AsyncIterator[None]:
        """Held by each update of ``adapter`` from its plan to its end, and by
        each reset of it: a reset never lands in the middle of an update, and
        an adapter's updates plan on what the one before committed. The lock
        is forgotten once nobody holds or awaits it."""
        lock, users = self._adapter_turns.get(adapter, (asyncio.Lock(), 0))
        self._adapter_turns[adapter] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._adapter_turns[adapter]
            if users == 1:
                del self._adapter_turns[adapter]
            else:
                self._adapter_turns[adapter] = (lock, users - 1)

    async def end(self) -> None:
        """Answer everyone still waiting, and let the replies go out."""
        # Nobody is left waiting for an answer that will never come.
        self.book.close(
            ErrorInfo(
                code=ErrorCode.NOT_LEADER,
                message="the coordinator stopped or lost its lease before this update "
                "finished; ask again with the same update_id for the outcome",
            )
        )
        await self.replies.close()

    async def still_leading(self) -> bool:
        """Whether the leader record still names this term: a coordinator that
        was stopped (SIGSTOP) may run on before it notices it was replaced,
        and must not commit over its successor's roll-back. An unreadable
        record is no evidence either way (the agents still fence by epoch);
        one that does not decode no longer names this term."""
        try:
            record, _ = await self.store.read_leader()
        except CorruptRecord:
            return False  # overwritten: this term's lease is gone, and it steps down
        except StoreUnavailable:
            return True
        return record is not None and (record.holder, record.epoch) == (self.holder, self.epoch)

    async def committed(self, adapter: str) -> CommittedRecord | None:
        """What is committed for ``adapter``: as this term knows it, else as
        stored. StoreUnavailable when unreadable: taken for none, it would let
        an older version commit."""
        return self.book.committed.get(adapter) or await self.store.read_committed(adapter)

    def finished(self, result: UpdateResult, *, ran: bool = True) -> UpdateFinished:
        """The event of a result; ``ran`` False: answered without running, so
        no member loaded anything for it and no rank map goes with it."""
        return UpdateFinished(
            ts=time.time(),
            source="coordinator",
            update_id=result.update_id,
            status=result.status,
            error=result.error,
            epoch=self.epoch,
            adapter=result.adapter,
            rank_map=result.rank_map if ran else None,
        )
