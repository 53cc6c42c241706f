"""The agent: commands in from the bus, acks, heartbeats and events out.

This module puts the agent's parts together and runs them: the connection
(:mod:`~lorabus.agents.bus`), what it obeys (:mod:`~lorabus.agents.fencing`),
the engine's queue (:mod:`~lorabus.agents.command_queue`), converging on the
committed state (:mod:`~lorabus.agents.convergence`) and heartbeats
(:mod:`~lorabus.agents.heartbeats`). A subscription callback only decodes,
fences and enqueues; one task drains the queue, so engine calls run one at a
time, in arrival order, and never block the subscription.

Addressing: a pause comes on this agent's own subject, naming it, in the
first update of a coordinator's term (and after this agent restarts); later
ones are one broadcast, which it takes only once a pause of that term named
it, unless it is excluded by name. The later commands of that update are
broadcast to the agents that took its pause (its cohort), so no message grows
with the fleet. Committed notices reach every agent.

Identity: each agent process beats and acks with a random instance id. If
another live agent already holds the worker id, the coordinator refuses this
one (a ``refuse_instance`` command naming its instance), and it stops with a
``duplicate_worker`` error.

Leaving: at start the agent resumes its engine (a predecessor may have died
with it paused), and on its way out it resumes an engine it paused.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from lorabus.agents.adapter_cache import AdapterCache
from lorabus.agents.beats import BeatPolicy
from lorabus.agents.bus import AgentBus
from lorabus.agents.cache_holders import CacheKeeper
from lorabus.agents.command_queue import CommandQueue, Work
from lorabus.agents.config import (
    MAX_ADAPTER_BYTES,
    MAX_PAUSE_LEASE_S,
    AgentConfig,
    default_cache_dir,
)
from lorabus.agents.convergence import Convergence
from lorabus.agents.engine import EngineDriver
from lorabus.agents.executor import CommandExecutor
from lorabus.agents.fencing import Fencing
from lorabus.agents.heartbeats import LATE_PAUSE, Heartbeats
from lorabus.agents.lease import LeaseState, PauseLease
from lorabus.agents.metrics import InstrumentedDriver
from lorabus.agents.pending_pause import PendingPause
from lorabus.errors import DuplicateWorker
from lorabus.runtime.cancellation import raise_if_cancelled
from lorabus.runtime.clock import now
from lorabus.runtime.event_loop import running_loop_name
from lorabus.schemas import (
    Ack,
    BadMessage,
    BadPayload,
    CanaryCommand,
    CommittedNotice,
    EngineResumed,
    LeaseExpired,
    LoadCommand,
    PauseCommand,
    RefuseInstance,
    RenewLeaseCommand,
    ResumeCommand,
    Subjects,
    addressing_of,
    command_decoder,
)
from lorabus.security.signing import CommandVerifier

if TYPE_CHECKING:
    from lorabus.agents.node import NodeLink

log = logging.getLogger(__name__)

_REMEMBERED_COHORTS = 64
_RESUME_ON_EXIT_S = 5.0
_LEASE_RESUME_BUDGET_S = 60.0


@dataclass(frozen=True)
class _Parts:
    """What one run of the agent works with, all on that run's connection."""

    bus: AgentBus
    fencing: Fencing
    queue: CommandQueue
    convergence: Convergence
    heartbeats: Heartbeats
    refused: asyncio.Future[RefuseInstance]
    """Set when the coordinator refuses this process its worker id."""


class Agent:
    """One agent: serves commands for ``executor.worker_id`` on ``subjects``' fleet."""

    def __init__(
        self,
        subjects: Subjects,
        executor: CommandExecutor,
        *,
        heartbeat_s: float,
        max_pause_lease_s: float = MAX_PAUSE_LEASE_S,
        verifier: CommandVerifier | None = None,
        max_adapter_bytes: int = MAX_ADAPTER_BYTES,
        late_pause_s: float = 0.0,
        labels: dict[str, str] | None = None,
    ) -> None:
        if heartbeat_s <= 0:
            raise ValueError("heartbeat interval must be > 0")
        self.subjects = subjects
        self.executor = executor
        self.worker_id = executor.worker_id
        self.heartbeat_s = heartbeat_s
        self.max_pause_lease_s = max_pause_lease_s
        self.max_adapter_bytes = max_adapter_bytes
        self.labels = dict(labels or {})
        """What its heartbeats announce, for placement (``--label``)."""
        self.late_pause_s = late_pause_s
        """How long after it was given up a pause may still land (the
        engine's call timeout): the lease of one that went unanswered is
        longer by this, so the agent's resumes outlast the late pause."""
        self.lease = PauseLease()
        self.verifier = verifier or CommandVerifier()
        self.instance = secrets.token_hex(8)
        """This process's identity among agents that share a worker id."""
        self._cohorts: OrderedDict[tuple[int, str], None] = OrderedDict()
        """(epoch, update id) of the pauses this agent took, newest last: a
        successor that runs the same update again starts a cohort of its own."""
        self._pause_received_at = 0.0
        self._announced = False
        """Its first heartbeat is out: from then on the coordinator may count it."""
        self._named_in_epoch = -1
        """The latest term whose leader sent this process a pause by name: it
        takes broadcast pauses of that term only (coordinator/lifecycle.py)."""
        self._convergence: Convergence | None = None
        """The running agent's, for :attr:`ready`."""
        self.node: NodeLink | None = None
        """Set by the node agent that runs this one (agents/node.py): the
        connection's broadcast and the outbox it shares with its node-mates."""

    @classmethod
    def from_config(cls, config: AgentConfig, driver: EngineDriver) -> Agent:
        """The agent ``config`` describes, driving its engine through ``driver``."""
        cache_dir = config.cache_dir or default_cache_dir(config.fleet)
        cache = AdapterCache(cache_dir, keep=config.cache_keep)
        holder = f"{config.fleet}.{config.worker_id}"  # one file per worker of each fleet
        keeper = CacheKeeper(
            cache,
            holder=holder,
            counts=driver.metrics if isinstance(driver, InstrumentedDriver) else None,
        )
        return cls(
            Subjects(fleet=config.fleet, prefix=config.subject_prefix),
            CommandExecutor(
                config.worker_id,
                config.world_size,
                driver,
                adapter_roots=config.adapter_roots,
                adapter_cache=cache,
                cache_keeper=keeper,
                max_adapters=config.max_adapters,
                role=config.role,
                pending_pause=PendingPause.in_cache(
                    cache_dir, holder, config.engine_timeout_s, config.max_pause_lease_s
                ),
            ),
            heartbeat_s=config.heartbeat_s,
            max_pause_lease_s=config.max_pause_lease_s,
            verifier=CommandVerifier(config.coordinator_keys, config.trust_file or None),
            max_adapter_bytes=config.max_adapter_bytes,
            late_pause_s=config.engine_timeout_s,
            labels=config.label_map,
        )

    @property
    def ready(self) -> bool:
        """Whether the engine holds everything the fleet has committed (every
        adapter's committed version and those kept beside it), as far as this
        agent knows (before it runs, it knows of nothing committed)."""
        return self._convergence is None or self._convergence.ready

    async def run(self, nc: NatsClient, ready: asyncio.Event | None = None) -> None:
        """Serve until cancelled; set ``ready`` once subscribed and announced."""
        parts = self._assemble(nc)
        self._convergence = parts.convergence
        subs = await parts.bus.subscribe_commands(partial(self._on_command, parts))
        try:
            await parts.bus.flush()
            await self._serve(parts, ready)
        except* DuplicateWorker as refused:
            raise refused.exceptions[0] from None
        finally:
            await parts.bus.unsubscribe(subs)
            await self._resume_if_paused(parts)
            if self.node is not None:
                self.node.outbox.untrack(self.worker_id)

    def _assemble(self, nc: NatsClient) -> _Parts:
        beats = BeatPolicy()
        bus = AgentBus(
            nc,
            self.subjects,
            self.worker_id,
            instance=self.instance,
            beats=beats,
            max_adapter_bytes=self.max_adapter_bytes,
            node=self.node,
        )
        self.executor.store_loads.fetch = bus.fetch_adapter
        fencing = Fencing(bus, self.executor, self.verifier, instance=self.instance)
        queue = CommandQueue(
            bus,
            self.executor,
            self.lease,
            max_pause_lease_s=self.max_pause_lease_s,
            late_pause_s=self.late_pause_s,
        )
        convergence = Convergence(bus, self.executor, fencing, queue)
        if self.node is not None:
            node, worker_id = self.node, self.worker_id
            queue.on_idle = node.outbox.nudge
            node.outbox.track(
                worker_id, lambda: queue.idle and not node.commands.pending(worker_id)
            )
        heartbeats = Heartbeats(
            bus,
            self.executor,
            beats,
            fencing,
            convergence,
            queue,
            interval_s=self.heartbeat_s,
            instance=self.instance,
            labels=self.labels,
        )
        refused = asyncio.get_running_loop().create_future()
        return _Parts(bus, fencing, queue, convergence, heartbeats, refused)

    async def _serve(self, parts: _Parts, ready: asyncio.Event | None) -> None:
        await parts.convergence.read_fleet_state()
        await self._resume_at_start(parts)
        self._expect_predecessor_pause()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._stop_if_refused(parts.refused))
            tasks.create_task(self._command_loop(parts))
            tasks.create_task(
                parts.fencing.recheck_loop(partial(self._on_command, parts, may_hold=False))
            )
            tasks.create_task(self.lease.watch(partial(self._on_lease_expired, parts)))
            # Converge before the first heartbeat, so the coordinator never
            # counts this worker while its engine lacks what the fleet serves.
            parts.convergence.reconcile_if_needed()
            await parts.convergence.wait_reconciled()
            await parts.heartbeats.beat()
            self._announced = True
            if ready is not None:
                ready.set()
            log.info(
                "worker=%s agent ready on fleet %s (event loop: %s)",
                self.worker_id,
                self.subjects.fleet,
                running_loop_name(),
            )
            tasks.create_task(parts.heartbeats.run())
            if self.executor.store_loads.cache_keeper is not None:
                # Housekeeping beside the commands, never inside one.
                tasks.create_task(self.executor.store_loads.cache_keeper.run())

    async def _stop_if_refused(self, refused: asyncio.Future[RefuseInstance]) -> None:
        refusal = await refused
        raise DuplicateWorker(
            f"worker id {self.worker_id!r} is held by another live agent (instance "
            f"{refusal.holder!r}); this one (instance {self.instance!r}) stops. Give each "
            "agent its own --worker-id, or stop the other one first."
        )

    # -- the bus side --------------------------------------------------------

    async def _on_command(self, parts: _Parts, msg: Msg, *, may_hold: bool = True) -> None:
        try:
            command = command_decoder.decode(msg.data)
        except BadPayload as exc:
            log.warning(
                "worker=%s dropped a malformed command on %r: %s", self.worker_id, msg.subject, exc
            )
            await parts.bus.report(
                BadMessage(
                    ts=time.time(),
                    source=parts.bus.source,
                    subject=msg.subject[:256],
                    error=str(exc)[:1024],
                    size=len(msg.data),
                )
            )
            return
        addressing = addressing_of(command, self.worker_id, self._cohorts)
        if addressing is None:
            return
        if not await parts.fencing.admit(msg, command, addressing, may_hold=may_hold):
            return
        fleet_pause = isinstance(command, PauseCommand) and command.cohort
        if fleet_pause and not self._countable(parts, command.epoch):
            # Checked and fenced like any command, but a broadcast pause is only
            # for workers the coordinator counts: one that a pause of its term
            # named, while it is ready (not starting up or converging). A pause
            # meant for it all the same comes again by name.
            return
        match command:
            case RefuseInstance(instance=instance):
                if instance == self.instance and not parts.refused.done():
                    parts.refused.set_result(command)
            case RenewLeaseCommand(update_id=update_id, lease_s=lease_s):
                self.lease.renew(update_id, parts.queue.lease_length(lease_s))
            case CommittedNotice():
                parts.convergence.take_notice(command)
            case PauseCommand():
                self._pause_received_at = now()
                if not command.cohort:
                    self._named_in_epoch = command.epoch
                self._join_cohort((command.epoch, command.update_id))
                await parts.queue.accept(command)
                if command.then_load is not None:
                    await parts.queue.accept_carried(command, command.then_load)
            case _:
                await parts.queue.accept(command)

    def _countable(self, parts: _Parts, epoch: int) -> bool:
        return epoch == self._named_in_epoch and self._announced and parts.convergence.settled

    def _join_cohort(self, key: tuple[int, str]) -> None:
        self._cohorts[key] = None
        self._cohorts.move_to_end(key)
        while len(self._cohorts) > _REMEMBERED_COHORTS:
            self._cohorts.popitem(last=False)

    # -- the engine side -----------------------------------------------------

    async def _command_loop(self, parts: _Parts) -> None:
        while True:
            raise_if_cancelled()
            work = await parts.queue.next()
            command = work.command
            if work.internal == "lease" and self.lease.state is LeaseState.HELD:
                continue  # a newer pause re-armed the lease meanwhile: it holds the engine
            if work.internal == LATE_PAUSE and (
                self.executor.paused
                or not self.executor.maybe_paused
                or self._pause_received_at > work.received
            ):
                continue  # a pause of an update holds the engine now, or none can land
            if work.internal == "retire" and (
                self.executor.paused or self._pause_received_at > work.received
            ):
                # The update goes first (an engine may refuse to unload while
                # paused); retiring runs again once the engine is resumed.
                log.debug("worker=%s put off retiring for a pause", self.worker_id)
                parts.convergence.put_off(command)
                continue
            if work.internal == "reconcile" and isinstance(command, LoadCommand):
                if not parts.convergence.still_missing(command):
                    # An update loaded it meanwhile, or a notice retired it.
                    parts.convergence.skipped(command)
                    if not parts.convergence.reconciling:
                        await parts.heartbeats.beat()
                    continue
            if work.internal:
                ack = await parts.queue.run_internal(work)
                await self._after_internal(parts, work, ack)
                continue
            if isinstance(command, PauseCommand) and command.then_load is not None:
                # At once, behind this engine's own pause: no other engine's pause
                # is waited for, and no second message is.
                await parts.queue.pause_then_load(command, command.then_load, work.received)
                continue
            if isinstance(command, CanaryCommand) and self.executor.paused:
                parts.queue.defer(work)  # another update of its round holds the pause
                continue
            await parts.queue.run(command, work.received)
            if isinstance(command, ResumeCommand) and not self.executor.paused:
                parts.convergence.retire_put_off()
                parts.queue.undefer()

    async def _after_internal(self, parts: _Parts, work: Work, ack: Ack) -> None:
        if work.internal == "reconcile":
            assert isinstance(work.command, LoadCommand)
            await parts.convergence.reconciled(work.command, ack)
        elif work.internal == "retire":
            await parts.convergence.retired(work.command, ack)
            return  # housekeeping: the next regular beat reports the shorter list
        elif work.internal == "lease":
            if ack.ok:
                self.lease.release()
                self.executor.late_pause_undone()
                parts.queue.undefer()
            await parts.bus.emit(
                LeaseExpired(
                    ts=time.time(),
                    source=parts.bus.source,
                    update_id=work.command.update_id,
                    worker_id=self.worker_id,
                    resumed=ack.ok,
                    error=ack.error,
                    epoch=work.command.epoch,
                )
            )
        await parts.heartbeats.beat()

    async def _on_lease_expired(self, parts: _Parts, update_id: str) -> None:
        log.warning(
            "worker=%s update=%s pause lease ran out: resuming the engine on its own",
            self.worker_id,
            update_id,
        )
        resume = ResumeCommand(
            update_id=update_id,
            targets=[self.worker_id],
            budget_s=_LEASE_RESUME_BUDGET_S,
            epoch=parts.fencing.epoch_seen,
        )
        parts.queue.put_internal(resume, "lease")

    # -- starting and leaving ------------------------------------------------

    async def resume_left_paused(self) -> None:
        """Resume an engine a predecessor may have left paused, before the bus
        is reached: no lease holds it, and waiting for NATS must not keep it
        paused. Never raises; once connected, :meth:`run` resumes it again
        and says so on the bus."""
        try:
            async with asyncio.timeout(_RESUME_ON_EXIT_S):
                await self.executor.resume_unasked()
        except Exception as exc:
            log.warning("worker=%s could not resume its engine at start: %s", self.worker_id, exc)

    async def _resume_at_start(self, parts: _Parts) -> None:
        """A predecessor that died (SIGKILL) may have left the engine paused, and
        no lease is held now: resuming an engine that runs is harmless."""
        try:
            async with asyncio.timeout(_RESUME_ON_EXIT_S):
                await self.executor.resume_unasked()
        except Exception as exc:
            log.warning("worker=%s could not resume its engine at start: %s", self.worker_id, exc)
            return
        await self._engine_resumed(parts, "agent start")

    def _expect_predecessor_pause(self) -> None:
        """A predecessor killed while its pause call was in flight: the engine
        may still carry that pause out, after the resume at start. Until it no
        longer can, the engine counts as maybe paused, as after an unanswered
        pause of this process's own: it is resumed at every beat, and a lease
        of that length ends it (:mod:`lorabus.agents.pending_pause`)."""
        pending = self.executor.pending_pause
        left_s = pending.left_s() if pending is not None else 0.0
        if left_s <= 0:
            return
        log.warning(
            "worker=%s a pause its last agent sent may still land for %.1fs: "
            "resuming the engine at every beat until then",
            self.worker_id,
            left_s,
        )
        self.executor.maybe_paused = True
        self.lease.arm(LATE_PAUSE, left_s)

    async def _resume_if_paused(self, parts: _Parts) -> None:
        """A stopping agent resumes its engine: nobody would be left to do it."""
        if not self.executor.paused:
            return
        try:
            async with asyncio.timeout(_RESUME_ON_EXIT_S):
                await self.executor.resume_unasked()
            log.warning("worker=%s resumed its engine on the way out", self.worker_id)
        except Exception as exc:
            log.error("worker=%s is stopping with its engine paused: %s", self.worker_id, exc)
            return
        await self._engine_resumed(parts, "agent stopping")

    async def _engine_resumed(self, parts: _Parts, reason: str) -> None:
        await parts.bus.emit(
            EngineResumed(
                ts=time.time(),
                source=parts.bus.source,
                worker_id=self.worker_id,
                reason=reason,
                epoch=parts.fencing.epoch_seen,
            )
        )
