"""The coordinator service: leadership, recovery, requests and the update loop.

With ``bus.py`` (core subjects) and ``store.py`` (KV), the only modules of the
coordinator that talk to NATS.

Every coordinator of a fleet follows heartbeats and acks, so a standby knows
the membership the moment it takes over. Only the leader answers update and
status requests and runs updates, one at a time, each command stamped with its
epoch. A new leader first rolls back the update its predecessor left in
flight (resume everyone, withdraw the uncommitted version) and records that
result, so a requester retrying the same ``update_id`` gets a terminal answer.

Callbacks never wait for an update: they hand requests to the book and reply
from tasks owned by the service, which answers or cancels them when it stops.

Nothing a request claims is taken on trust. One that does not decode (not
JSON, nested too deeply, too large, an id or a version out of bounds) is
answered ``bad_request`` and reported as a ``bad_message`` event. One that
needs no engine is answered on arrival, without queueing: invalid as given, a
version older than the committed one, exactly what is committed, a repeated
update id (its first result, or ``bad_request`` for other content; see
``book.py``), superseded by a queued one, or one past a full queue (``busy``).
So junk costs a pause only if it is a valid update, and at most
``--max-queued`` of those wait ahead of any request; an orchestrator's
credentials still allow that many, each a pause of the fleet.

Nor is where a request wants its answer: before anything else, a request
whose reply subject is no inbox (the store, the JetStream API, a command, an
ack, an event; ``bus.reply_refusal``) is refused and not acted on, counted
(``lorabus_replies_refused_total``) and reported as a ``bad_message`` event.
An update whose answer could go nowhere safe does not run: its requester
would never learn the outcome, and a refusal costs the fleet nothing.

A record of the store that does not decode (``CorruptRecord``) is reported
the same way and replaced by what is safe, so that no one record stops the
fleet: the leader record is elected over (``leader.py``); an adapter's
commit point whose version is unknown is reset to a new lineage (no served
name is reused, whatever version comes next); the latest record is treated
as absent and rewritten by the next commit; an in-flight record is rolled
back as far as can be without knowing its update (every live member resumed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from lorabus.cancellation import raise_if_cancelled
from lorabus.clock import now
from lorabus.coordinator.alerts import MemberAlerts
from lorabus.coordinator.book import UpdateBook, failed_result
from lorabus.coordinator.bus import CoordinatorBus, reply_refusal
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.fit import fit_result, fit_status
from lorabus.coordinator.frontend import FrontendClient
from lorabus.coordinator.gather import AckRouter
from lorabus.coordinator.leader import LeaderElection
from lorabus.coordinator.lifecycle import CommandBus, UpdateRunner
from lorabus.coordinator.membership import Membership
from lorabus.coordinator.metrics import CoordinatorMetrics
from lorabus.coordinator.plan import (
    UpdatePlan,
    is_already_committed,
    plan_update_off_loop,
    retired_names,
)
from lorabus.coordinator.store import COMMITTED as COMMITTED_KEY
from lorabus.coordinator.store import INFLIGHT, CorruptRecord, FleetStore
from lorabus.coordinator.streams import unsafe_settings
from lorabus.errors import (
    BadRequest,
    LeadershipLost,
    LorabusError,
    SteppedAside,
    StoreUnavailable,
)
from lorabus.event_loop import running_loop_name
from lorabus.rate_limit import PerSecond
from lorabus.schemas import (
    COMMITTED,
    FAILED,
    MAX_MESSAGE_BYTES,
    UNKNOWN,
    BadMessage,
    BadPayload,
    CommittedNotice,
    CommittedRecord,
    CommittedReset,
    ErrorCode,
    ErrorInfo,
    FleetStatus,
    InflightRecord,
    LeaderElected,
    MemberAlert,
    MemberStatus,
    Phase,
    ResetRecord,
    ResetRequest,
    ResetResult,
    Subjects,
    UpdateFinished,
    UpdateRequest,
    UpdateResult,
    WorkerIdConflict,
    build_rank_map,
    encode,
    reset_request_decoder,
    result_request_decoder,
    update_request_decoder,
)
from lorabus.signing import CommandSigner

log = logging.getLogger(__name__)

_ANSWERS_FIRST_S = 1.0
"""How long a finished update's notice waits for its answers to go out (a
reply is one publish; this bounds a connection that stalls)."""

_T = TypeVar("_T")
ALERT_CHECK_S = 1.0
"""How often the leader looks for members that need a person's look."""
_REMEDIES = {
    False: "read as absent: an adapter whose commit point it is is reset at its next update, "
    "and the latest record is rewritten at the next commit",
    True: "read as an update of unknown content: every live member resumed, nothing withdrawn",
}
"""What recovery does with a committed record, and an in-flight record, that
does not decode."""
_BAD_EVENTS_PER_S = 10
"""Malformed requests are all answered and logged; this many a second are also
``bad_message`` events, so junk cannot flood the audit trail."""


@dataclass(frozen=True)
class _Executed:
    """An update's result; a commit comes with its record and the notice that
    tells the agents of it, both for after the answer."""

    result: UpdateResult
    committed: CommittedRecord | None = None
    notice: CommittedNotice | None = None
    commit_point_stored: bool = False
    in_flight_stored: bool | None = None
    """None: the update wrote no in-flight record; else whether it landed."""

    @property
    def rebuildable(self) -> bool:
        """A successor can rebuild the result from the store: the update is
        in flight there and its commit point is stored. Such a commit may be
        answered before its result and the latest record are written."""
        return self.commit_point_stored and self.in_flight_stored is True


@dataclass(frozen=True)
class _Unsettled:
    """A commit whose writes after its answer did not all land: this term's
    own, or one its predecessor left that recovery could not record in full."""

    update_id: str
    write_again: Callable[[FleetStore], Awaitable[tuple[bool, bool]]]
    """Writes what is missing: whether this term still leads, and whether
    everything landed."""


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.subjects = Subjects(fleet=config.fleet, prefix=config.subject_prefix)
        self.holder = (
            config.holder or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.membership = Membership()
        self.signer = (
            CommandSigner.from_file(config.signing_key_file) if config.signing_key_file else None
        )
        self.alerts = MemberAlerts()
        self.metrics = CoordinatorMetrics(self.membership, self.alerts)
        self.book = UpdateBook(max_queued=config.max_queued)
        self.epoch = 0
        self._bad_events = PerSecond(_BAD_EVENTS_PER_S)
        self._acks: AckRouter | None = None
        self._serial = asyncio.Lock()
        """Held by each update while it runs and by each reset: a reset never
        lands in the middle of an update."""
        self._unsettled: _Unsettled | None = None
        """The last commit (this term's, or one recovered from its predecessor)
        whose writes after the answer did not all land: written again before
        the next update or reset."""
        self.leading = asyncio.Event()
        """Set while this coordinator holds the fleet's lease."""
        self._max_payload: Callable[[], int] = lambda: MAX_MESSAGE_BYTES
        """The largest message the bus carries (the server's, once connected)."""
        self._answering: dict[str, set[asyncio.Task[None]]] = {}
        """Per update id, the tasks that will answer its askers once it finishes
        (owned by the request subscription, which cancels them at the end)."""
        self._own_inbox = ""
        """This coordinator's inbox prefix, where no request may have its answer sent."""

    async def run(self, nc: NatsClient, ready: asyncio.Event | None = None) -> None:
        """Serve the fleet until cancelled; set ``ready`` once following the bus.

        ``ready`` means "up": leading, or standing by to take over.
        """
        self._max_payload = lambda: nc.max_payload
        bus = CoordinatorBus(
            nc,
            self.subjects,
            self.membership,
            heartbeat_range_s=(self.config.min_heartbeat_s, self.config.max_heartbeat_s),
            leading=self.leading.is_set,
            epoch=lambda: self.epoch,
            signer=self.signer,
        )
        store = await self._open_store(nc)
        self._own_inbox = nc.new_inbox().rpartition(".")[0]
        election = LeaderElection(
            store,
            self.holder,
            self.config.leader_lease_s,
            signing_key=self.signer.public_key if self.signer is not None else "",
            epoch_floor=self._highest_epoch_seen,
            on_corrupt=partial(
                self._report_corrupt,
                bus,
                remedy="elected over by compare-and-set on its revision, once no lease runs",
            ),
        )
        frontend = FrontendClient(
            self.config.frontend_url,
            headers=self.config.headers,
            timeout_s=self.config.http_timeout_s,
        )
        runner = UpdateRunner(self.config, self.membership, frontend, bus, store, self.metrics)
        self._acks = bus.acks
        subs = await bus.follow()
        try:
            await nc.flush(timeout=5)
            if ready is not None:
                ready.set()
            log.info(
                "coordinator %s ready on fleet %s: following heartbeats, leading when it "
                "can (event loop: %s)",
                self.holder,
                self.config.fleet,
                running_loop_name(),
            )
            while True:
                raise_if_cancelled()
                self.epoch = await election.campaign()
                # A task of its own per term: Python 3.11's TaskGroup cancels the
                # task it runs in to abort the term, and never uncancels it (fixed
                # in 3.12). That count stays on the term's task, so this one counts
                # only a stop, also one that comes while a term steps down.
                await asyncio.create_task(self._term(nc, store, runner, bus, election))
        finally:
            await _unsubscribe(subs)
            await frontend.aclose()

    async def _term(
        self,
        nc: NatsClient,
        store: FleetStore,
        runner: UpdateRunner,
        bus: CoordinatorBus,
        election: LeaderElection,
    ) -> None:
        """Lead until the lease is lost (a step-down: return) or cancelled."""
        try:
            async with asyncio.TaskGroup() as term:
                term.create_task(election.hold())
                term.create_task(self._lead(nc, store, runner, bus))
                term.create_task(self._watch_members(bus))
                term.create_task(self._check_streams(nc, bus))
        except* LeadershipLost as lost:
            log.warning("epoch=%d stepped down: %s", self.epoch, lost.exceptions[0])
            if any(isinstance(exc, SteppedAside) for exc in lost.exceptions):
                election.stand_aside()

    async def _open_store(self, nc: NatsClient) -> FleetStore:
        """Open the fleet's KV; JetStream can take a while (a cluster electing its
        meta leader, a server restarting), so keep trying with a growing pause."""
        return await _until_stored(lambda: FleetStore.open(nc, self.config, self.signer))

    async def _lead(
        self, nc: NatsClient, store: FleetStore, runner: UpdateRunner, bus: CoordinatorBus
    ) -> None:
        """One term as leader: recover, then serve requests until cancelled."""
        runner.epoch = self.epoch
        self.book = UpdateBook(max_queued=self.config.max_queued)
        self._unsettled = None  # an earlier term's stays in flight, for recovery
        replies: set[asyncio.Task[None]] = set()
        subs: list[Subscription] = []
        try:
            recovered = await self._recover(store, runner)
            await self._announce_term(bus)
            await bus.emit(
                LeaderElected(
                    ts=time.time(),
                    source="coordinator",
                    holder=self.holder,
                    epoch=self.epoch,
                    recovered=recovered,
                )
            )
            served = {
                "update": (
                    self.subjects.update_request(),
                    self._make_request_cb(replies, bus, store),
                ),
                "status": (self.subjects.status_request(), self._on_status),
                "result": (
                    self.subjects.result_request(),
                    self._make_result_cb(replies, bus, store),
                ),
                "reset": (
                    self.subjects.reset_request(),
                    self._make_reset_cb(replies, bus, store),
                ),
            }
            subs = [
                await nc.subscribe(subject, cb=self._inbox_only(kind, bus, serve))
                for kind, (subject, serve) in served.items()
            ]
            self.leading.set()
            self.metrics.leading.set(1)
            self.metrics.epoch.set(self.epoch)
            log.info(
                "coordinator %s leads fleet %s, epoch %d",
                self.holder,
                self.config.fleet,
                self.epoch,
            )
            await self._run_updates(runner, bus, store)
        finally:
            self.leading.clear()
            self.metrics.leading.set(0)
            await _unsubscribe(subs)
            # Nobody is left waiting for an answer that will never come.
            self.book.close(
                ErrorInfo(
                    code=ErrorCode.NOT_LEADER,
                    message="the coordinator stopped or lost its lease before this update "
                    "finished; ask again with the same update_id for the outcome",
                )
            )
            await _settle(replies, timeout_s=2.0)

    async def _watch_members(self, bus: CoordinatorBus) -> None:
        """For one term: raise and clear member alerts (``member_alert`` events,
        a WARNING line each, and the metrics) every ALERT_CHECK_S."""
        try:
            while True:
                await asyncio.sleep(ALERT_CHECK_S)
                if not self.leading.is_set():
                    continue  # still recovering: the book is not this term's yet
                changes = self.alerts.evaluate(
                    self.membership.live(), update_running=self.book.running is not None, at=now()
                )
                for change in changes:
                    if change.cleared:
                        log.info("worker=%s no longer %s", change.worker_id, change.condition)
                    else:
                        log.warning(
                            "worker=%s needs a look: %s (%s)",
                            change.worker_id,
                            change.condition,
                            change.reason,
                        )
                    await bus.emit(
                        MemberAlert(
                            ts=time.time(),
                            source="coordinator",
                            epoch=self.epoch,
                            worker_id=change.worker_id,
                            condition=change.condition,
                            reason=change.reason,
                            cleared=change.cleared,
                        )
                    )
        finally:
            self.alerts.forget()

    async def _record_committed(
        self,
        store: FleetStore,
        runner: UpdateRunner,
        in_flight: InflightRecord,
        committed: CommittedRecord,
        recorded: UpdateResult | None,
        *,
        commit_point: bool = False,
    ) -> bool:
        """Write what an answered commit may lack: the latest record, unless a
        later commit's is there, and the result (``commit_point``: the commit
        point first, which failed before the answer and after it). Whether
        all are stored now; if not, they are written again before this term's
        first update or reset, which would replace the in-flight record a
        successor could rebuild them from."""
        result = None
        if recorded is None:
            log.warning(
                "epoch=%d update=%s found in flight but committed: recording its result",
                self.epoch,
                in_flight.update_id,
            )
            result = UpdateResult(
                update_id=in_flight.update_id,
                status=COMMITTED,
                adapter=committed.served_name,
                version=committed.version,
                rank_map=committed.rank_map,
                path=committed.path,
                digest=committed.digest,
            )
            # Ahead of the writes: stopped between them, a successor writes
            # the result again, and the trail still has the update's end.
            await runner.bus.emit(self._finished(result))
        write = partial(
            self._write_recovered, committed=committed, result=result, commit_point=commit_point
        )
        leading, landed = await write(store)
        if not leading:
            raise LeadershipLost(f"epoch {self.epoch} was deposed while it recovered")
        if not landed:
            self._unsettled = _Unsettled(in_flight.update_id, write)
        return landed

    async def _commit_answered(
        self,
        store: FleetStore,
        in_flight: InflightRecord,
        recorded: UpdateResult,
        committed: CommittedRecord | None,
        bus: CommandBus,
    ) -> CommittedRecord:
        """The committed record of an update answered committed, rebuilt from
        its in-flight record and its result (its lineage is the one it ran in:
        no reset runs during an update)."""
        log.warning(
            "epoch=%d update=%s found in flight, answered committed, without its commit "
            "point: writing it",
            self.epoch,
            in_flight.update_id,
        )
        assert recorded.rank_map is not None
        try:
            lineage = await _until_stored(
                lambda: self._lineage(store, in_flight.adapter, committed, bus),
                for_s=self.config.leader_lease_s,
            )
        except StoreUnavailable as exc:
            raise SteppedAside(f"could not read the lineage of {in_flight.adapter}: {exc}") from exc
        return CommittedRecord(
            adapter=in_flight.adapter,
            version=in_flight.version,
            path=in_flight.path or recorded.path or "",
            served_name=in_flight.served_name,
            rank_map=recorded.rank_map,
            lineage=lineage,
            digest=recorded.digest,
        )

    async def _write_recovered(
        self,
        store: FleetStore,
        *,
        committed: CommittedRecord,
        result: UpdateResult | None,
        commit_point: bool,
    ) -> tuple[bool, bool]:
        """The latest record of a recovered commit, unless a later commit's is
        there, its ``result`` (if it had none) and its commit point (if asked):
        whether this term still leads, and whether all are stored. Written
        twice, none changes what the first write did."""
        if not await self._still_leading(store):
            return False, False
        # The commit point before the latest record, as ever.
        if commit_point and not await _quietly(store.commit(committed)):
            return True, False
        behind = await _or_none(store.latest_behind(committed.adapter))
        latest_stored = behind is False or (
            behind is True and await _quietly(store.write_latest(committed))
        )
        if behind:
            self.book.commit(committed)
        result_stored = result is None or await _quietly(store.write_result(result))
        return True, latest_stored and result_stored

    async def _announce_term(self, bus: CoordinatorBus) -> None:
        """Tell every agent the committed state under this term's epoch: those
        outside any update learn the new epoch (and refuse the old leader) at
        once, and one that missed a notice converges."""
        committed = self.book.latest
        if committed is None:
            return
        notice = CommittedNotice(
            update_id=f"term-{self.epoch}",
            budget_s=0.0,
            epoch=self.epoch,
            served_name=committed.served_name,
            path=committed.path,
            version=committed.version,
            lineage=committed.lineage,
            digest=committed.digest,
        )
        await self._announce(bus, notice)  # if lost, agents learn the epoch from a command

    async def _recover(self, store: FleetStore, runner: UpdateRunner) -> str | None:
        """Load the committed state; roll back an update a predecessor left in flight."""
        found = await self._read_left_state(store)
        for corrupt in found.corrupt:
            await self._report_corrupt(
                runner.bus, corrupt, remedy=_REMEDIES[corrupt.key == INFLIGHT]
            )
        if found.committed is not None:
            self.book.commit(found.committed)
        in_flight, recorded, committed_it = found.in_flight, found.result, found.commit_point
        if found.in_flight_unknown:
            await self._resume_everyone(runner)
            await _quietly(store.clear_inflight())
            return None
        if in_flight is None:
            return None
        settled = True
        if committed_it is not None and _records_commit_of(committed_it, in_flight):
            # It stopped after its commit point (every member had resumed),
            # maybe before its result and the latest record were written:
            # rolling back would withdraw a committed version.
            settled = await self._record_committed(store, runner, in_flight, committed_it, recorded)
        elif (
            recorded is not None
            and recorded.committed
            and recorded.rank_map is not None
            and _newer_than(in_flight, committed_it)
        ):
            # Answered "committed" with its result stored, while its commit
            # point failed, before the answer and again after it: left out,
            # the adapter's committed version would go back to the one before.
            record = await self._commit_answered(
                store, in_flight, recorded, committed_it, runner.bus
            )
            settled = await self._record_committed(
                store, runner, in_flight, record, recorded, commit_point=True
            )
        elif recorded is None and found.commit_point_unknown:
            # It may have committed: resume everyone, withdraw nothing, and
            # record no outcome (its adapter is reset at its next update).
            await self._resume_everyone(runner, in_flight)
        elif recorded is None:
            await self._roll_back(store, runner, in_flight)
        if settled:  # else it stays until written again, before this term's first update
            await _quietly(store.clear_inflight())
        return in_flight.update_id

    async def _read_left_state(self, store: FleetStore) -> _LeftState:
        """What a predecessor left, read whole before any of it is acted on, and
        read again until it can be: a commit point that could not be read is no
        evidence that there is none, and rolling back on it would withdraw a
        version whose requester was told it committed. Serving nothing
        meanwhile, the term steps down after a lease of failed reads, so that
        a standby may try (the lease itself holds as long as the state bucket
        does, and the results bucket may be what fails)."""
        try:
            return await _until_stored(
                lambda: _LeftState.read(store), for_s=self.config.leader_lease_s
            )
        except StoreUnavailable as exc:
            raise SteppedAside(
                f"could not read the state a predecessor left for a whole lease: {exc}"
            ) from exc

    async def _resume_everyone(
        self, runner: UpdateRunner, in_flight: InflightRecord | None = None
    ) -> None:
        """Roll back an update in flight as far as can be without knowing what
        it loaded: resume every member it named (or, unknown, every live one)."""
        members = (
            in_flight.members
            if in_flight is not None
            else {wid: m.heartbeat.world_size for wid, m in self.membership.live().items()}
        )
        if not members:
            return  # an agent's pause lease runs out on its own
        blind = InflightRecord(
            update_id=in_flight.update_id if in_flight is not None else f"unknown-{self.epoch}",
            epoch=in_flight.epoch if in_flight is not None else 0,
            phase=Phase.PAUSE,  # nothing is withdrawn
            adapter="",
            served_name="",
            version=0,
            members=members,
        )
        error = await runner.roll_back(blind)
        log.warning("epoch=%d resumed %d members: %s", self.epoch, len(members), error.message)

    async def _roll_back(
        self, store: FleetStore, runner: UpdateRunner, in_flight: InflightRecord
    ) -> None:
        log.warning(
            "epoch=%d update=%s found in flight (%s): rolling back",
            self.epoch,
            in_flight.update_id,
            in_flight.phase,
        )
        error = await runner.roll_back(in_flight)
        result = UpdateResult(
            update_id=in_flight.update_id,
            status="failed",
            adapter=in_flight.served_name,
            version=in_flight.version,
            error=error,
            path=in_flight.path or None,
        )
        await _quietly(store.write_result(result))
        await runner.bus.emit(self._finished(result))

    def _finished(self, result: UpdateResult, *, ran: bool = True) -> UpdateFinished:
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

    async def _run_updates(
        self, runner: UpdateRunner, bus: CoordinatorBus, store: FleetStore
    ) -> None:
        while True:
            raise_if_cancelled()
            request = await self.book.next_request()
            started = now()
            async with self._serial:
                executed = await self._execute(request, runner, store)
                # One form for the store, the trail and every answer.
                result = fit_result(executed.result, self._max_payload())
                self.metrics.update_seconds.observe(now() - started)
                self.metrics.updates.labels(result.status).inc()
                # Deposed while it ran (stopped, cut off), the successor rolled
                # this update back, recorded that result and may have an
                # update of its own in flight; neither may be overwritten.
                recording = executed.committed is not None or await self._still_leading(store)
                # A commit a successor could rebuild from the store is answered
                # before its result is written. Any other result (a failure,
                # "already committed", a commit whose commit point or in-flight
                # record did not land) is written first.
                persisted = (
                    recording
                    and not executed.rebuildable
                    and await _quietly(store.write_result(result))
                )
                # Before the answer: a trail read once the answer is in holds
                # the end of the update (one publish, to the audit stream only).
                await bus.emit(self._finished(result))
                # Before the answer too: the requester may stop this process once
                # it has it (as a test, or a script, does).
                log.info(
                    "epoch=%d update=%s %s %s",
                    self.epoch,
                    request.update_id,
                    result.status,
                    result.error.message if result.error else result.adapter,
                )
                self.book.finish(request, result, persisted=persisted)
                # The rest waits for the answers, which must not queue behind
                # it: a commit's result and the fleet's latest record, then the
                # record in flight, only once both are stored (a successor
                # rebuilds them from it), and the notice to N agents last. An
                # agent that misses the notice reads the latest record when it
                # reconnects, or hears the next term's.
                await self._answers_sent(request.update_id)
                # Only this update's own record: one an earlier commit still
                # needs (its writes after its answer failed) goes when they land.
                clearing = recording and executed.in_flight_stored is not None
                if executed.committed is not None:
                    recording, clearing = await _despite_a_stop(
                        self._store_commit(store, result, executed, persisted=persisted)
                    )
                    if recording and not clearing:
                        self._unsettled = _Unsettled(
                            result.update_id,
                            partial(
                                self._store_commit,
                                result=result,
                                executed=executed,
                                persisted=persisted,
                            ),
                        )
                if clearing:
                    await _quietly(store.clear_inflight())
                if recording and executed.notice is not None:
                    await self._announce(bus, executed.notice)
                if not recording:
                    # Deposed: step down now, not at the next lease renewal,
                    # so no later request gets an answer from this term.
                    raise LeadershipLost(f"epoch {self.epoch} was deposed during an update")

    async def _settle_earlier_commit(self, store: FleetStore) -> None:
        """Write again what the last commit (this term's, or one recovered from
        its predecessor) could not store after its answer, before any update
        or reset runs: an update's in-flight record would replace the one a
        successor rebuilds those writes from, and a reset must not be undone
        by a late write of what it removed. Failing again, they stay owed and
        the request is refused (StoreUnavailable), touching nothing."""
        unsettled = self._unsettled
        if unsettled is None:
            return
        leading, landed = await unsettled.write_again(store)
        if not leading:
            raise LeadershipLost(f"epoch {self.epoch} was deposed between updates")
        if not landed:
            raise StoreUnavailable(
                f"the fleet's store has not recorded all of update {unsettled.update_id}'s "
                "commit, which must come first: nothing was done; ask again"
            )
        self._unsettled = None
        await _quietly(store.clear_inflight())

    async def _execute(
        self, request: UpdateRequest, runner: UpdateRunner, store: FleetStore
    ) -> _Executed:
        """Run ``request``; a commit's commit point is written here, and what
        else it needs stored and sent is returned for after the answer."""
        try:
            await self._settle_earlier_commit(store)
            try:
                committed = await self._committed(store, request.adapter)
            except CorruptRecord as corrupt:
                await self._reset_unknown(store, runner.bus, request.adapter, corrupt)
                committed = None
            lineage = await self._lineage(store, request.adapter, committed, runner.bus)
            plan = await plan_update_off_loop(request, self.config, committed, lineage)
            if committed is not None and is_already_committed(plan, committed):
                return _Executed(_already_committed(request, committed))
            result = await runner.run(plan)
            in_flight = runner.in_flight_stored
            if not await self._still_leading(store):
                # Its own outcome is no answer: a failure may be only the agents
                # fencing this term off, and the new leader runs the update.
                deposed = ErrorInfo(
                    code=ErrorCode.NOT_LEADER,
                    message=f"epoch {self.epoch} was deposed before "
                    + (
                        f"committing {plan.served_name}; the new leader rolls the update back"
                        if result.committed
                        else "the update ended; ask again: the new leader answers"
                    ),
                )
                return _Executed(failed_result(request, deposed))
            if not result.committed or result.rank_map is None:
                return _Executed(result)
            record = CommittedRecord(
                adapter=plan.adapter,
                version=plan.version,
                path=plan.path,
                served_name=plan.served_name,
                rank_map=result.rank_map,
                lineage=plan.lineage,
                digest=result.digest,
            )
            self.book.commit(record)
            stored = await _quietly(store.commit(record))
            notice = CommittedNotice(
                update_id=plan.update_id,
                budget_s=0.0,
                epoch=self.epoch,
                served_name=plan.served_name,
                path=plan.path,
                version=plan.version,
                retire=self._retired(plan, result),
                lineage=plan.lineage,
                digest=result.digest,
            )
            return _Executed(
                result, record, notice, commit_point_stored=stored, in_flight_stored=in_flight
            )
        except LorabusError as exc:
            return _Executed(failed_result(request, exc.info()))
        except Exception as exc:
            log.exception("update=%s crashed", request.update_id)
            crashed = ErrorInfo(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
            return _Executed(failed_result(request, crashed))

    async def _store_commit(
        self, store: FleetStore, result: UpdateResult, executed: _Executed, *, persisted: bool
    ) -> tuple[bool, bool]:
        """Write what an answered commit still needs stored, together: its
        result, the fleet's latest record (and its commit point, if that
        failed before). Whether this term still leads, and whether everything
        landed: only then may the in-flight record go."""
        committed = executed.committed
        assert committed is not None
        if not await self._still_leading(store):
            # Deposed since the commit: the successor found the update in
            # flight and records it, and may have committed since.
            return False, False
        # The commit point before the latest record, as ever: a latest record
        # must never name what no commit point holds.
        if not executed.commit_point_stored and not await _quietly(store.commit(committed)):
            return True, False
        writes = [store.write_latest(committed)]
        if not persisted:
            writes.append(store.write_result(result))
        landed = await asyncio.gather(*(_quietly(write) for write in writes))
        if not persisted and landed[-1]:
            self.book.saved(result.update_id)
        return True, all(landed)

    async def _lineage(
        self,
        store: FleetStore,
        adapter: str,
        committed: CommittedRecord | None,
        bus: CommandBus | None = None,
    ) -> int:
        """The lineage ``adapter``'s next commit belongs to. Without a committed
        record, the reset record decides, and an unreadable one fails the
        update: guessing lineage 0 could reuse a served name from before a reset."""
        if committed is not None:
            return committed.lineage
        known = self.book.lineages.get(adapter)
        if known is None:
            known = self.book.lineages[adapter] = await self._reset_lineage(store, bus, adapter)
        return known

    async def _reset_lineage(self, store: FleetStore, bus: CommandBus | None, adapter: str) -> int:
        """The lineage of ``adapter``'s latest reset (0: none). A reset record
        that does not decode stands for its revision plus one: every reset
        writes a record of the bucket, so no lineage yet exceeds a revision,
        and the names of a lineage past it were never served."""
        try:
            reset = await store.read_reset(adapter)
        except CorruptRecord as corrupt:
            await self._report_corrupt(bus, corrupt, remedy="taken for a lineage past its revision")
            return corrupt.revision + 1
        return reset.lineage if reset is not None else 0

    async def _reset_unknown(
        self, store: FleetStore, bus: CommandBus, adapter: str, corrupt: CorruptRecord
    ) -> int:
        """Reset an adapter whose commit point does not decode: its committed
        version is unknown, so no version can be checked against it, and a
        new lineage makes every later served name new whatever comes next.
        Recorded like an operator's reset (``committed_reset``); the new lineage."""
        reason = f"the committed record of {adapter!r} does not decode: its version is unknown"
        await self._report_corrupt(bus, corrupt, remedy="reset to a new lineage")
        if not self.leading.is_set() or not await self._still_leading(store):
            raise LeadershipLost(f"epoch {self.epoch} no longer leads: nothing was reset")
        lineage = max(
            await self._reset_lineage(store, bus, adapter), self.book.lineages.get(adapter, 0)
        )
        lineage += 1
        await store.reset_committed(
            ResetRecord(
                adapter=adapter,
                lineage=lineage,
                previous_version=0,
                previous_path="",
                reason=reason,
                ts=time.time(),
            )
        )
        self.book.reset(adapter, lineage)
        await bus.emit(
            CommittedReset(
                ts=time.time(),
                source="coordinator",
                epoch=self.epoch,
                adapter=adapter,
                lineage=lineage,
                previous_version=0,
                previous_path="",
                previous_served_name="",
                reason=reason,
            )
        )
        return lineage

    async def _still_leading(self, store: FleetStore) -> bool:
        """Whether the leader record still names this term: a coordinator that
        was stopped (SIGSTOP) may run on before it notices it was replaced,
        and must not commit over its successor's roll-back. An unreadable
        record is no evidence either way (the agents still fence by epoch);
        one that does not decode no longer names this term."""
        try:
            record, _ = await store.read_leader()
        except CorruptRecord:
            return False  # overwritten: this term's lease is gone, and it steps down
        except StoreUnavailable:
            return True
        return record is not None and (record.holder, record.epoch) == (self.holder, self.epoch)

    def _retired(self, plan: UpdatePlan, result: UpdateResult) -> list[str]:
        """Versions of the adapter beyond ``keep``, among those the engines hold."""
        if plan.replace:
            return []
        loaded = {name for worker in result.workers.values() for name in worker.adapters}
        return sorted(retired_names(plan.adapter, loaded, self.config.keep))

    def _make_request_cb(
        self, replies: set[asyncio.Task[None]], bus: CoordinatorBus, store: FleetStore
    ) -> Callable[[Msg], Awaitable[None]]:
        last_joined: asyncio.Event | None = None
        """Set once the latest request to arrive has joined the book."""
        answering: dict[tuple[str, str], asyncio.Task[None]] = {}
        """(reply subject, update id) -> the task that will answer it."""

        async def on_request(msg: Msg) -> None:
            nonlocal last_joined
            try:
                request = update_request_decoder.decode(msg.data)
            except BadPayload as exc:
                await self._malformed(msg, bus, exc)
                return
            key = (msg.reply, request.update_id)
            if msg.reply and key in answering:
                # A requester asks again on the inbox of its first ask: one answer
                # reaches it. More would also break a server's one-response-per-
                # request permission (allow_responses) of a secured coordinator.
                return
            previous, last_joined = last_joined, asyncio.Event()
            reply = asyncio.create_task(
                self._answer(msg, request, store, bus, previous, last_joined)
            )
            replies.add(reply)
            reply.add_done_callback(replies.discard)
            if msg.reply:
                answering[key] = reply
                reply.add_done_callback(lambda _: answering.pop(key, None))

        return on_request

    def _make_result_cb(
        self, replies: set[asyncio.Task[None]], bus: CoordinatorBus, store: FleetStore
    ) -> Callable[[Msg], Awaitable[None]]:
        async def on_result(msg: Msg) -> None:
            try:
                request = result_request_decoder.decode(msg.data)
            except BadPayload as exc:
                error = f"malformed result request: {exc}"[:1024]
                await self._report_bad(msg, bus, error)
                info = BadRequest(error).info()
                await self._reply(
                    msg,
                    UpdateResult(update_id="", status=FAILED, adapter="", version=None, error=info),
                )
                return
            reply = asyncio.create_task(self._answer_result(msg, request.update_id, store))
            replies.add(reply)
            reply.add_done_callback(replies.discard)

        return on_result

    async def _answer_result(self, msg: Msg, update_id: str, store: FleetStore) -> None:
        """The id's outcome: this term's, else the results bucket's, else unknown
        (a store that cannot be read says so, rather than "unknown")."""
        outcome = self.book.outcome(update_id)
        if outcome is None:
            try:
                outcome = await store.read_result(update_id)
            except StoreUnavailable as exc:
                outcome = UpdateResult(
                    update_id=update_id,
                    status=FAILED,
                    adapter="",
                    version=None,
                    error=ErrorInfo(code=ErrorCode.INTERNAL, message=str(exc)),
                )
            except BadPayload:
                outcome = None
        await self._reply(
            msg,
            outcome or UpdateResult(update_id=update_id, status=UNKNOWN, adapter="", version=None),
        )

    def _make_reset_cb(
        self, replies: set[asyncio.Task[None]], bus: CoordinatorBus, store: FleetStore
    ) -> Callable[[Msg], Awaitable[None]]:
        async def on_reset(msg: Msg) -> None:
            try:
                request = reset_request_decoder.decode(msg.data)
            except BadPayload as exc:
                error = f"malformed reset request: {exc}"[:1024]
                await self._report_bad(msg, bus, error)
                await self._reply(
                    msg, ResetResult(adapter="", ok=False, error=BadRequest(error).info())
                )
                return
            reply = asyncio.create_task(self._answer_reset(msg, request, bus, store))
            replies.add(reply)
            reply.add_done_callback(replies.discard)

        return on_reset

    async def _answer_reset(
        self, msg: Msg, request: ResetRequest, bus: CoordinatorBus, store: FleetStore
    ) -> None:
        try:
            async with self._serial:
                await self._settle_earlier_commit(store)
                result = await self._reset(request, bus, store)
        except LorabusError as exc:
            result = ResetResult(adapter=request.adapter, ok=False, error=exc.info())
        except Exception as exc:
            log.exception("epoch=%d reset of %r crashed", self.epoch, request.adapter)
            error = ErrorInfo(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
            result = ResetResult(adapter=request.adapter, ok=False, error=error)
        await self._reply(msg, result)

    async def _reset(
        self, request: ResetRequest, bus: CoordinatorBus, store: FleetStore
    ) -> ResetResult:
        """Forget what is committed for the request's adapter (between updates)."""
        adapter = request.adapter
        try:
            committed = self.book.committed.get(adapter) or await store.read_committed(adapter)
        except CorruptRecord as corrupt:  # unknown version: no expected_version can match
            lineage = await self._reset_unknown(store, bus, adapter, corrupt)
            return ResetResult(
                adapter=adapter, ok=True, lineage=lineage, previous_version=0, previous_path=""
            )
        if committed is None:
            raise BadRequest(f"nothing is committed for adapter {adapter!r}: nothing to reset")
        if request.expected_version is not None and request.expected_version != committed.version:
            raise BadRequest(
                f"adapter {adapter!r} has version {committed.version} committed, not "
                f"{request.expected_version}: nothing was reset"
            )
        if not self.leading.is_set() or not await self._still_leading(store):
            raise LeadershipLost(f"epoch {self.epoch} no longer leads: nothing was reset")
        lineage = max(committed.lineage, await self._reset_lineage(store, bus, adapter)) + 1
        await store.reset_committed(
            ResetRecord(
                adapter=adapter,
                lineage=lineage,
                previous_version=committed.version,
                previous_path=committed.path,
                reason=request.reason,
                ts=time.time(),
            )
        )
        self.book.reset(adapter, lineage)
        log.warning(
            "epoch=%d reset the committed state of %r (was version %d from %s), lineage %d: %s",
            self.epoch,
            adapter,
            committed.version,
            committed.path,
            lineage,
            request.reason,
        )
        await bus.emit(
            CommittedReset(
                ts=time.time(),
                source="coordinator",
                epoch=self.epoch,
                adapter=adapter,
                lineage=lineage,
                previous_version=committed.version,
                previous_path=committed.path,
                previous_served_name=committed.served_name,
                reason=request.reason,
            )
        )
        return ResetResult(
            adapter=adapter,
            ok=True,
            lineage=lineage,
            previous_version=committed.version,
            previous_path=committed.path,
        )

    def _inbox_only(
        self, kind: str, bus: CoordinatorBus, serve: Callable[[Msg], Awaitable[None]]
    ) -> Callable[[Msg], Awaitable[None]]:
        """``serve`` for requests whose answer may go where they ask; any other
        is refused before anything is done for it (see the module docstring)."""

        async def on_request(msg: Msg) -> None:
            why = reply_refusal(msg.reply, self.subjects, self._own_inbox)
            if why is None:
                await serve(msg)
                return
            self.metrics.replies_refused.labels(kind).inc()
            reply = msg.reply[:256]
            error = f"{kind} request refused, not acted on: its reply subject {reply!r} is {why}"
            await self._report_bad(msg, bus, error)

        return on_request

    async def _malformed(self, msg: Msg, bus: CoordinatorBus, exc: BadPayload) -> None:
        """Answer and report a request that does not decode; nothing it says is used."""
        error = f"malformed update request: {exc}"[:1024]
        await self._report_bad(msg, bus, error)
        info = BadRequest(error).info()
        await self._reply(
            msg, UpdateResult(update_id="", status=FAILED, adapter="", version=None, error=info)
        )

    async def _report_bad(self, msg: Msg, bus: CoordinatorBus, error: str) -> None:
        """Log a request that is not served as sent (it does not decode, or its
        reply subject is no inbox), and emit ``bad_message`` at most
        ``_BAD_EVENTS_PER_S`` times a second."""
        log.warning("epoch=%d %s (%d bytes on %s)", self.epoch, error, len(msg.data), msg.subject)
        await self._emit_bad(bus, msg.subject, error[:1024], len(msg.data))

    async def _emit_bad(self, bus: CommandBus, subject: str, error: str, size: int) -> None:
        if self._bad_events.take():
            await bus.emit(
                BadMessage(
                    ts=time.time(),
                    source="coordinator",
                    epoch=self.epoch,
                    subject=subject[:256],
                    error=error,
                    size=size,
                )
            )

    async def _report_corrupt(
        self, bus: CommandBus | None, corrupt: CorruptRecord, *, remedy: str
    ) -> None:
        """Log and audit (``bad_message``, on the record's KV subject; with no
        bus, only log) a record of the store that does not decode, and what is
        done about it."""
        error = f"{corrupt}; {remedy}; it began {corrupt.excerpt}"[:1024]
        log.error("epoch=%d %s", self.epoch, error)
        if bus is not None:
            subject = f"$KV.{self.subjects.state_bucket()}.{corrupt.key}"
            await self._emit_bad(bus, subject, error, 0)

    async def _check_streams(self, nc: NatsClient, bus: CommandBus) -> None:
        """Log and audit (``bad_message``) each setting of the fleet's streams
        that lorabus would not have made: no lorabus role may change them, so
        one found is the work of another hand (docs/security.md)."""
        for stream, problem in await unsafe_settings(nc.jetstream(), self.config):
            log.error("epoch=%d %s", self.epoch, problem)
            await self._emit_bad(bus, f"$JS.API.STREAM.INFO.{stream}", problem, 0)

    def _highest_epoch_seen(self) -> int:
        """The highest epoch the live agents' heartbeats say they have seen."""
        live = self.membership.live().values()
        return max((member.heartbeat.epoch_seen for member in live), default=0)

    async def _answer(
        self,
        msg: Msg,
        request: UpdateRequest,
        store: FleetStore,
        bus: CoordinatorBus,
        previous: asyncio.Event | None,
        joined: asyncio.Event,
    ) -> None:
        """Reply with the request's result. Look-ups run at once, but requests
        join the book in the order they arrived: each waits for the one before."""
        try:
            stored: UpdateResult | None = None
            committed: CommittedRecord | None = None
            if not self.book.knows(request.update_id):
                # A predecessor may have finished (or rolled back) this update.
                stored, committed = await asyncio.gather(
                    _stored_result(store, request.update_id),
                    _or_none(self._committed(store, request.adapter)),
                )
            if previous is not None:
                await previous.wait()
            future = await self._admit(request, stored, committed)
        except Exception as exc:
            log.exception("epoch=%d update=%s could not be admitted", self.epoch, request.update_id)
            error = ErrorInfo(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
            await self._reply(msg, failed_result(request, error))
            return
        finally:
            joined.set()
        await self._save_settled(store, bus)
        if future.done():
            await self._reply(msg, future.result())
            return
        # Known as answering this update: its notice to the agents waits for us.
        answering = self._answering.setdefault(request.update_id, set())
        this = asyncio.current_task()
        if this is not None:
            answering.add(this)
        try:
            await self._reply(msg, await asyncio.shield(future))
        finally:
            answering.discard(this)
            if not answering and self._answering.get(request.update_id) is answering:
                del self._answering[request.update_id]

    async def _announce(self, bus: CoordinatorBus, notice: CommittedNotice) -> None:
        try:
            await bus.broadcast(notice)
        except Exception as exc:  # the next term's notice, or a reconnect's read, converges
            log.warning("epoch=%d could not announce %s: %s", self.epoch, notice.served_name, exc)

    async def _answers_sent(self, update_id: str) -> None:
        """Let the askers of a just-finished update have their answers sent."""
        answering = self._answering.get(update_id)
        if answering:
            await asyncio.wait(set(answering), timeout=_ANSWERS_FIRST_S)

    async def _committed(self, store: FleetStore, adapter: str) -> CommittedRecord | None:
        """What is committed for ``adapter``: as this term knows it, else as
        stored. StoreUnavailable when unreadable: taken for none, it would let
        an older version commit."""
        return self.book.committed.get(adapter) or await store.read_committed(adapter)

    async def _admit(
        self, request: UpdateRequest, stored: UpdateResult | None, committed: CommittedRecord | None
    ) -> asyncio.Future[UpdateResult]:
        """The future result of ``request``, answered at once unless it must run."""
        known = self.book.look_up(request, stored=stored, committed=committed)
        if known is not None:
            return known
        committed = self.book.committed.get(request.adapter) or committed
        refusal = await self._refusal(request, committed)
        if refusal is not None:
            return self.book.settle(request, refusal)
        return self.book.enqueue(request)

    async def _refusal(
        self, request: UpdateRequest, committed: CommittedRecord | None
    ) -> UpdateResult | None:
        """The answer to a new request that needs no engine: invalid as given,
        older than the committed version, or exactly what is committed (checked
        again when it runs: the committed state may have moved on by then)."""
        try:
            plan = await plan_update_off_loop(request, self.config, committed)
        except LorabusError as exc:
            return failed_result(request, exc.info())
        if committed is not None and is_already_committed(plan, committed):
            return _already_committed(request, committed)
        return None

    async def _save_settled(self, store: FleetStore, bus: CoordinatorBus) -> None:
        """Write and announce the results the book settled without running them."""
        for result in self.book.take_settled():
            if await _quietly(store.write_result(result)):
                self.book.saved(result.update_id)
            await bus.emit(self._finished(result, ran=False))

    async def _on_status(self, msg: Msg) -> None:
        await self._reply(msg, self.status())

    async def _reply(self, msg: Msg, message: msgspec.Struct) -> None:
        """Answer ``msg``. A result or a status too large for one message goes
        trimmed (fit.py), whether it was made now or read from the store."""
        if isinstance(message, UpdateResult):
            message = fit_result(message, self._max_payload())
        elif isinstance(message, FleetStatus):
            message = fit_status(message, self._max_payload())
        if not msg.reply:
            return
        try:
            await msg.respond(encode(message))
        except Exception as exc:
            log.warning("could not reply on %s: %s", msg.reply, exc)

    def status(self) -> FleetStatus:
        live = self.membership.live()
        latest = self.book.latest
        rank_map = (
            latest.rank_map
            if latest
            else build_rank_map({wid: m.heartbeat.world_size for wid, m in live.items()})
        )
        offsets = {entry.worker_id: entry.rank_offset for entry in rank_map.entries}
        members = [
            MemberStatus(
                worker_id=wid,
                world_size=m.heartbeat.world_size,
                engine=m.heartbeat.engine,
                paused=m.heartbeat.paused,
                adapters=m.heartbeat.adapters,
                heartbeat_age_s=round(self.membership.age_of(m), 3),
                rank_offset=offsets.get(wid),
                ready=m.heartbeat.ready,
                unready_reason=m.heartbeat.unready_reason,
                unreadable_state=m.heartbeat.unreadable_state,
            )
            for wid, m in sorted(live.items())
        ]
        return FleetStatus(
            fleet=self.config.fleet,
            expected_world_size=self.config.expected_world_size,
            live_world_size=sum(m.world_size for m in members),
            members=members,
            committed_adapter=latest.served_name if latest else None,
            committed_version=latest.version if latest else None,
            rank_map=latest.rank_map if latest else None,
            in_flight=self.book.running,
            epoch=self.epoch,
            leader=self.holder,
            conflicts=[
                WorkerIdConflict(
                    worker_id=contender.heartbeat.worker_id,
                    holder=self.membership.instance_of(contender.heartbeat.worker_id) or "",
                    refused=contender.heartbeat.instance,
                    age_s=age_s,
                )
                for contender, age_s in self.membership.conflicts()
            ],
            **self._phase_progress(),
        )

    def _phase_progress(self) -> dict[str, Any]:
        gather = self._acks.latest() if self._acks is not None else None
        if gather is None or gather.update_id != self.book.running:
            return {}
        return {
            "in_flight_phase": str(gather.phase),
            "acked": sorted(gather.acks),
            "waiting": sorted(gather.waiting),
        }


def _already_committed(request: UpdateRequest, committed: CommittedRecord) -> UpdateResult:
    return UpdateResult(
        update_id=request.update_id,
        status=COMMITTED,
        adapter=committed.served_name,
        version=committed.version,
        rank_map=committed.rank_map,
        path=committed.path,
    )


@dataclass(frozen=True)
class _LeftState:
    """The fleet's records as a new leader finds them."""

    committed: CommittedRecord | None
    """The latest commit: the adapter's own record (the commit point), as the
    fleet's latest record is written after it and may lag or be missing."""
    in_flight: InflightRecord | None
    result: UpdateResult | None
    """The stored result of the update in flight."""
    commit_point: CommittedRecord | None
    """The committed record of the in-flight update's adapter."""
    corrupt: tuple[CorruptRecord, ...] = ()
    """Records that did not decode, each read as absent: the latest record (or
    its adapter's commit point: then neither is taken for committed), the
    in-flight record, the in-flight adapter's commit point."""

    @property
    def in_flight_unknown(self) -> bool:
        return any(c.key == INFLIGHT for c in self.corrupt)

    @property
    def commit_point_unknown(self) -> bool:
        """The in-flight adapter's commit point did not decode: whether its
        update committed is unknown."""
        return self.in_flight is not None and any(
            c.key == f"{COMMITTED_KEY}.{self.in_flight.adapter}" for c in self.corrupt
        )

    @classmethod
    async def read(cls, store: FleetStore) -> _LeftState:
        """Every record, or StoreUnavailable: none is read as absent on a
        failure, but one that does not decode is (reported in ``corrupt``)."""
        corrupt: list[CorruptRecord] = []

        async def readable(read: Awaitable[_T]) -> _T | None:
            try:
                return await read
            except CorruptRecord as exc:
                if all(c.key != exc.key for c in corrupt):
                    corrupt.append(exc)
                return None

        latest = await readable(store.read_committed())
        if latest is not None:
            own = await readable(store.read_committed(latest.adapter))
            if corrupt:
                latest = None  # its adapter is reset when it is next updated
            elif own is not None:
                latest = own
        in_flight = await readable(store.read_inflight())
        if in_flight is None:
            return cls(latest, None, None, None, tuple(corrupt))
        try:
            # Unsealed or garbled, it is no result (and is reported): the
            # commit point, not a stored answer, says whether it committed.
            result = await readable(store.read_result(in_flight.update_id))
        except BadPayload as exc:
            log.warning(
                "the stored result of %s does not decode, ignored: %s", in_flight.update_id, exc
            )
            result = None
        commit_point = await readable(store.read_committed(in_flight.adapter))
        return cls(latest, in_flight, result, commit_point, tuple(corrupt))


async def _stored_result(store: FleetStore, update_id: str) -> UpdateResult | None:
    """The id's result in the results bucket; one that does not decode counts as none."""
    try:
        return await _or_none(store.read_result(update_id))
    except BadPayload as exc:
        log.warning("the stored result of update %s does not decode, ignored: %s", update_id, exc)
        return None


async def _until_stored(call: Callable[[], Awaitable[_T]], *, for_s: float = math.inf) -> _T:
    """``call()`` again, after a pause growing from 0.2 s to 5 s, while it
    raises StoreUnavailable; past ``for_s`` the last such error is raised."""
    give_up_at = now() + for_s
    pause = 0.2
    while True:
        raise_if_cancelled()
        try:
            return await call()
        except StoreUnavailable as exc:
            if now() >= give_up_at:
                raise
            log.warning("%s; retrying in %.1fs", exc, pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 5.0)


async def _or_none(awaitable: Awaitable[_T]) -> _T | None:
    """Await a store read; an unreachable store reads as "nothing there" (logged)."""
    try:
        return await awaitable
    except StoreUnavailable as exc:
        log.warning("store: %s", exc)
        return None


def _records_commit_of(committed: CommittedRecord, in_flight: InflightRecord) -> bool:
    return (committed.served_name, committed.version) == (in_flight.served_name, in_flight.version)


def _newer_than(in_flight: InflightRecord, committed: CommittedRecord | None) -> bool:
    """Whether the update in flight is newer than the adapter's commit point."""
    return committed is None or committed.version < in_flight.version


async def _despite_a_stop(work: Awaitable[_T], grace_s: float = 2.0) -> _T:
    """Await ``work``; stopped meanwhile, give it ``grace_s`` to land first (an
    answered commit's records), then cancel it and stop."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        try:
            await asyncio.wait({task}, timeout=grace_s)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        raise


async def _unsubscribe(subs: list[Subscription]) -> None:
    for sub in subs:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _quietly(awaitable: object) -> bool:
    """Await a store write whose failure must not stop the fleet (it is logged);
    False when it failed."""
    try:
        await awaitable  # type: ignore[misc]
    except StoreUnavailable as exc:
        log.warning("store: %s", exc)
        return False
    return True


async def _settle(tasks: set[asyncio.Task[None]], timeout_s: float) -> None:
    """Let pending replies go out, then cancel and await whatever is left."""
    if not tasks:
        return
    _, late = await asyncio.wait(set(tasks), timeout=timeout_s)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
