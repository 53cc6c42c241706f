"""The coordinator service: following the fleet, and leading it one term at a time.

With ``bus.py`` (core subjects), ``admission.py`` (requests) and ``store.py``
(KV), the only modules of the coordinator that talk to NATS.

Every coordinator of a fleet follows heartbeats and acks, so a standby knows
the membership the moment it takes over. One holds the fleet's lease
(``leader.py``) and leads, in terms: each term is a :class:`~.term.Term`
with its own epoch, which every command carries. A term first recovers what
its predecessor left (``recovery.py``: an update left in flight is finished
or rolled back, and its result recorded, so a requester retrying the same
``update_id`` gets a terminal answer), then tells every agent its epoch,
serves the request subjects (``admission.py``) and runs updates, one at a
time (``updates.py``, ``commit.py``), until its lease is lost or the
coordinator stops.

A record of the store that does not decode (``CorruptRecord``) is reported
(``reports.py``) and replaced by what is safe, so that no one record stops
the fleet: the leader record is elected over (``leader.py``); an adapter's
commit point whose version is unknown is reset to a new lineage (no served
name is reused, whatever version comes next); the latest record is treated
as absent and rewritten by the next commit; an in-flight record is rolled
back as far as can be without knowing its update (every live member resumed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from lorabus.bus.connect import wait_flushed
from lorabus.client import REASK_S
from lorabus.coordinator.adapter_store import AdapterStore
from lorabus.coordinator.admission import Admission
from lorabus.coordinator.alerts import MemberAlerts
from lorabus.coordinator.book import book_of
from lorabus.coordinator.bus import CoordinatorBus
from lorabus.coordinator.commit import announce_term, housekeep
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.frontend import FrontendClient
from lorabus.coordinator.gather import AckRouter
from lorabus.coordinator.leader import LeaderElection
from lorabus.coordinator.lifecycle import UpdateRunner
from lorabus.coordinator.membership import Membership
from lorabus.coordinator.metrics import CoordinatorMetrics
from lorabus.coordinator.ports import Frontend
from lorabus.coordinator.recovery import recover
from lorabus.coordinator.replacement import replace_departed
from lorabus.coordinator.reports import Reports
from lorabus.coordinator.signals import LeadershipLost, SteppedAside
from lorabus.coordinator.status import fleet_status
from lorabus.coordinator.store import FleetStore, until_stored
from lorabus.coordinator.streams import unsafe_settings
from lorabus.coordinator.tenants import Tenants
from lorabus.coordinator.term import Term
from lorabus.coordinator.updates import run_updates
from lorabus.runtime.cancellation import raise_if_cancelled
from lorabus.runtime.clock import now
from lorabus.runtime.event_loop import running_loop_name
from lorabus.schemas import MAX_MESSAGE_BYTES, FleetStatus, LeaderElected, MemberAlert, Subjects
from lorabus.schemas.nodes import NodeRoster
from lorabus.security.signing import CommandSigner

log = logging.getLogger(__name__)

ALERT_CHECK_S = 1.0
"""How often the leader looks for members that need a person's look."""
_UNROUTED_PROBES = 3
"""Probes answered "no responders" in a row before a leader steps aside."""
_SWEEP_TICK_S = 1.0
"""The shortest wait between two looks whether a sweep of the store is due."""


@dataclass(frozen=True)
class _Followed:
    """What a coordinator sets up once, to follow the fleet and to lead it:
    every term's parts are made from these."""

    bus: CoordinatorBus
    reports: Reports
    store: FleetStore
    election: LeaderElection
    adapters: AdapterStore
    frontend: Frontend


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        frontend: Frontend | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        """``frontend``: what the verify phase asks; by default an HTTP client of
        ``config.frontend_url``, opened and closed by :meth:`run`. ``tenants``:
        by default those of ``config.tenants_file`` (ValueError if it cannot
        be read)."""
        self.config = config
        self.tenants = tenants if tenants is not None else Tenants.load(config.tenants_file)
        self.nodes = NodeRoster.load(config.nodes_file, secured=bool(config.signing_key_file))
        self._frontend = frontend
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
        self.book = book_of(config)
        """The current (or last) term's book."""
        self.epoch = 0
        """The current (or last) term's epoch."""
        self.leading = asyncio.Event()
        """Set while this coordinator holds the fleet's lease and serves requests."""
        self._acks: AckRouter | None = None
        self._max_payload: Callable[[], int] = lambda: MAX_MESSAGE_BYTES
        """The largest message the bus carries (the server's, once connected)."""
        self._own_inbox = ""
        self._probe = b"lorabus-probe:" + secrets.token_hex(16).encode()
        """What this process's probes of its own subscriptions carry (:meth:`_check_routed`)."""
        """This coordinator's inbox prefix, where no request may have its answer sent."""

    async def run(self, nc: NatsClient, ready: asyncio.Event | None = None) -> None:
        """Serve the fleet until cancelled; set ``ready`` once following the bus.

        ``ready`` means "up": leading, or standing by to take over.
        """
        self._max_payload = lambda: nc.max_payload
        self.metrics.bus_connected.set_function(lambda: nc.is_connected)
        async with self._frontend_client() as frontend:
            followed = await self._follow(nc, frontend)
            subs = await followed.bus.follow()
            try:
                # NATS may be away right now (restarting, say): wait for it.
                await wait_flushed(
                    nc, who=f"coordinator {self.holder} of fleet {self.config.fleet}"
                )
                if ready is not None:
                    ready.set()
                log.info(
                    "coordinator %s ready on fleet %s: following heartbeats, leading when "
                    "it can (event loop: %s)",
                    self.holder,
                    self.config.fleet,
                    running_loop_name(),
                )
                await self._lead_when_elected(nc, followed)
            finally:
                await _unsubscribe(subs)

    @contextlib.asynccontextmanager
    async def _frontend_client(self) -> AsyncIterator[Frontend]:
        """The frontend the verify phase asks: the one given, else an HTTP
        client of ``config.frontend_url``, closed at the end."""
        if self._frontend is not None:
            yield self._frontend
            return
        owned = FrontendClient(
            self.config.frontend_url,
            headers=self.config.headers,
            timeout_s=self.config.http_timeout_s,
        )
        try:
            yield owned
        finally:
            await owned.aclose()

    async def _follow(self, nc: NatsClient, frontend: Frontend) -> _Followed:
        """The bus, the stores and the election this coordinator follows the
        fleet with, and leads it with when elected."""
        bus = CoordinatorBus(
            nc,
            self.subjects,
            self.membership,
            heartbeat_range_s=(self.config.min_heartbeat_s, self.config.max_heartbeat_s),
            leading=self.leading.is_set,
            epoch=lambda: self.epoch,
            signer=self.signer,
            nodes=self.nodes,
        )
        self._acks = bus.acks
        reports = Reports(bus, self.subjects, lambda: self.epoch, tenants=self.tenants.by_name)
        # JetStream can take a while (a cluster electing its meta leader, a
        # server restarting), so keep trying with a growing pause.
        store = await until_stored(lambda: FleetStore.open(nc, self.config, self.signer))
        self._own_inbox = nc.new_inbox().rpartition(".")[0]
        election = LeaderElection(
            store,
            self.holder,
            self.config.leader_lease_s,
            signing_key=self.signer.public_key if self.signer is not None else "",
            epoch_floor=self._highest_epoch_seen,
            on_corrupt=lambda corrupt: reports.corrupt(
                corrupt,
                remedy="elected over by compare-and-set on its revision, once no lease runs",
            ),
        )
        adapters = AdapterStore(
            nc,
            self.subjects,
            orphan_after_s=self.config.orphan_after_s,
            tenants=self.tenants.by_name,
        )
        return _Followed(bus, reports, store, election, adapters, frontend)

    async def _lead_when_elected(self, nc: NatsClient, followed: _Followed) -> None:
        """Campaign, lead one term, and again, until cancelled."""
        while True:
            raise_if_cancelled()
            self.epoch = await followed.election.campaign()
            term = self._new_term(followed)
            self.book = term.book
            runner = UpdateRunner(
                self.config,
                self.membership,
                followed.frontend,
                followed.bus,
                followed.store,
                self.metrics,
                epoch=self.epoch,
            )
            # A task of its own per term: Python 3.11's TaskGroup cancels the
            # task it runs in to abort the term, and never uncancels it (fixed
            # in 3.12). That count stays on the term's task, so this one counts
            # only a stop, also one that comes while a term steps down.
            await asyncio.create_task(self._term(nc, term, runner, followed.election))

    def _new_term(self, followed: _Followed) -> Term:
        return Term(
            epoch=self.epoch,
            holder=self.holder,
            config=self.config,
            store=followed.store,
            bus=followed.bus,
            membership=self.membership,
            metrics=self.metrics,
            reports=followed.reports,
            leading=self.leading,
            max_payload=self._max_payload,
            adapters=followed.adapters,
        )

    def status(self) -> FleetStatus:
        return fleet_status(
            self.config,
            self.membership,
            self.book,
            self._acks,
            epoch=self.epoch,
            leader=self.holder,
        )

    async def _term(
        self, nc: NatsClient, term: Term, runner: UpdateRunner, election: LeaderElection
    ) -> None:
        """Lead until the lease is lost (a step-down: return) or cancelled."""
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(election.hold())
                tasks.create_task(self._lead(nc, term, runner))
                tasks.create_task(self._watch_members(term))
                tasks.create_task(self._check_streams(nc, term))
                tasks.create_task(self._sweep_store(term))
                tasks.create_task(replace_departed(term))
                tasks.create_task(self._check_routed(nc, term))
        except* LeadershipLost as lost:
            log.warning("epoch=%d stepped down: %s", term.epoch, lost.exceptions[0])
            if any(isinstance(exc, SteppedAside) for exc in lost.exceptions):
                election.stand_aside()

    async def _lead(self, nc: NatsClient, term: Term, runner: UpdateRunner) -> None:
        """One term as leader: recover, then serve requests until cancelled."""
        subs: list[Subscription] = []
        try:
            recovered = await recover(term, runner)
            if term.epoch > 1:
                # A predecessor's requesters ask again within a re-ask
                # interval: its pause-mode requests form this term's first
                # round together, not the first to come back alone.
                term.book.rounds_from = now() + REASK_S
            await announce_term(term)
            await term.bus.emit(
                LeaderElected(
                    ts=time.time(),
                    source="coordinator",
                    holder=self.holder,
                    epoch=term.epoch,
                    recovered=", ".join(recovered) or None,
                )
            )
            admission = Admission(
                term,
                status=self.status,
                own_inbox=self._own_inbox,
                tenants=self.tenants,
                probe=self._probe,
            )
            subs = await admission.subscribe(nc)
            self.leading.set()
            self.metrics.leading.set(1)
            self.metrics.epoch.set(term.epoch)
            log.info(
                "coordinator %s leads fleet %s, epoch %d",
                self.holder,
                self.config.fleet,
                term.epoch,
            )
            await run_updates(term, runner)
        finally:
            self.leading.clear()
            self.metrics.leading.set(0)
            await _unsubscribe(subs)
            await term.end()

    async def _watch_members(self, term: Term) -> None:
        """For one term: raise and clear member alerts (``member_alert`` events,
        a WARNING line each, and the metrics) every ALERT_CHECK_S."""
        try:
            while True:
                await asyncio.sleep(ALERT_CHECK_S)
                if not self.leading.is_set():
                    continue  # still recovering: the book is not this term's yet
                changes = self.alerts.evaluate(
                    self.membership.live(), update_running=term.book.running is not None, at=now()
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
                    await term.bus.emit(
                        MemberAlert(
                            ts=time.time(),
                            source="coordinator",
                            epoch=term.epoch,
                            worker_id=change.worker_id,
                            condition=change.condition,
                            reason=change.reason,
                            cleared=change.cleared,
                        )
                    )
        finally:
            self.alerts.forget()

    async def _check_streams(self, nc: NatsClient, term: Term) -> None:
        """Log and audit (``bad_message``) each setting of the fleet's streams
        that lorabus would not have made: no lorabus role may change them, so
        one found is the work of another hand (docs/security.md)."""
        for stream, problem in await unsafe_settings(nc.jetstream(), self.config):
            log.error("epoch=%d %s", term.epoch, problem)
            await term.reports.bad(f"$JS.API.STREAM.INFO.{stream}", problem, 0)

    async def _sweep_store(self, term: Term) -> None:
        """For one term: sweep the adapter store whenever a sweep is due
        (coordinator/adapter_store.py), alone: no commit writes its records in
        the middle of one. Also when no update commits: a
        store full of orphans refuses the pushes that updates need."""
        while True:
            await asyncio.sleep(max(term.adapters.next_sweep_in(), _SWEEP_TICK_S))
            if not self.leading.is_set() or not term.adapters.sweep_due():
                continue  # still recovering, or a sweep came sooner
            async with term.records.deleting():
                await housekeep(term, sweep=True)

    async def _check_routed(self, nc: NatsClient, term: Term) -> None:
        """For one term: every lease, while leading and connected, ask the
        fleet's status subject with a body only this process knows, which
        its own subscription drops unanswered (so the ask times out). The
        server answering that nobody listens there (no responders) means it
        no longer routes the fleet's requests to this leader, which lost its
        subscriptions (seen once after two server restarts, with the leader
        stopped during its reconnect): after ``_UNROUTED_PROBES`` such
        answers in a row it steps aside, and the next term, its own or a
        standby's, subscribes afresh."""
        every_s = self.config.leader_lease_s
        unrouted = 0
        while True:
            await asyncio.sleep(every_s)
            if not self.leading.is_set() or not nc.is_connected:
                unrouted = 0
                continue
            try:
                await nc.request(term.subjects.status_request(), self._probe, timeout=every_s)
            except nats.errors.NoRespondersError:
                unrouted += 1
            except (TimeoutError, nats.errors.Error):
                unrouted = 0  # it reached a subscription
            if unrouted >= _UNROUTED_PROBES:
                raise SteppedAside(
                    f"the server has routed none of {unrouted} probes of "
                    f"{term.subjects.status_request()} to this leader: its subscriptions are gone"
                )

    def _highest_epoch_seen(self) -> int:
        """The highest epoch the live agents' heartbeats say they have seen."""
        live = self.membership.live().values()
        return max((member.heartbeat.epoch_seen for member in live), default=0)


async def _unsubscribe(subs: list[Subscription]) -> None:
    for sub in subs:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
