"""The agent's side of the bus: commands in, acks, heartbeats and events out.

This is the only module of ``agents`` that talks to NATS (core subjects, and
one JetStream KV read of the fleet's committed state). A subscription
callback only decodes, fences and enqueues: engine calls take seconds and
would stall every later message of that subscription. One worker task drains
the queue, so commands for the engine run one at a time, in arrival order.

Addressing: a pause comes on this agent's own subject, naming it, in the
first update of a coordinator's term (and after this agent restarts); later
ones are one broadcast, which it takes only once a pause of that term named
it, unless it is excluded by name. The later commands of that update are
broadcast to the agents that took its pause (its cohort), so no message grows
with the fleet. Committed notices reach every agent.

Core NATS is at-most-once, so the coordinator re-sends commands to agents that
have not acked. A re-sent command is recognised by (epoch, update id, type):
if it already ran, its ack is published again; if it is queued, it is dropped.

Fencing: every command carries its coordinator's epoch; the agent remembers
the highest it has seen and refuses anything older, with a ``fenced`` ack and a
``command_refused`` event, so a deposed coordinator cannot drive the engine.
A higher epoch is adopted only once the fleet's leader record in KV shows it:
a command that merely claims one is dropped (``command_refused``, no ack, as
the real leader re-sends to agents that have not acked), so a forged epoch can
neither be obeyed nor fence out the real coordinator. A new leader's first
commands can arrive just after this agent read the record's previous state:
the newest such command per subject is held and checked once more after the
next read, so the agent need not wait for the leader's re-send.

Signatures: an agent pinned to the fleet's coordinator keys obeys a command
only if it is signed by the key that the leader record of its epoch names,
for the subject it arrived on, and not replayed (see :mod:`lorabus.signing`).
The sequence numbers it took live only in this process: a command sent by
name names the agent process it is for (``instance``), so after a restart
none signed before reaches it, and the first it takes is its floor for the
broadcasts of that epoch (docs/protocol.md, "Replays").

Fleet state: a record in KV that does not decode is ignored (the agent keeps
the epoch and committed state it knew) and reported, in every heartbeat
(``unreadable_state``) and once as a ``bad_message`` event.

Identity: each agent process beats and acks with a random instance id. If
another live agent already holds the worker id, the coordinator refuses this
one (a ``refuse_instance`` command naming its instance), and it stops with a
``duplicate_worker`` error.

Readiness: the agent announces ``ready`` only while its engine holds what the
fleet has committed. At start, after a reconnect, and whenever its engine turns
out to have lost the adapter, it loads the committed adapter first. A
committed notice also names the older versions to retire: the agent unloads
those its engine holds, on its own, once the update has been answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import msgspec
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from lorabus.agents.beats import BeatPolicy
from lorabus.agents.config import MAX_PAUSE_LEASE_S, MIN_PAUSE_LEASE_S, AgentConfig
from lorabus.agents.engine import EngineDriver
from lorabus.agents.executor import CommandExecutor
from lorabus.agents.lease import LeaseState, PauseLease
from lorabus.cancellation import raise_if_cancelled
from lorabus.clock import now
from lorabus.errors import DuplicateWorker
from lorabus.event_loop import running_loop_name
from lorabus.rate_limit import PerSecond
from lorabus.schemas import (
    INSTANCE_BOUND_SINCE,
    Ack,
    Addressing,
    BadMessage,
    BadPayload,
    Command,
    CommandHandled,
    CommandRefused,
    CommittedNotice,
    EngineResumed,
    ErrorCode,
    ErrorInfo,
    Event,
    Heartbeat,
    LeaderRecord,
    LeaseExpired,
    LoadCommand,
    LoadSpec,
    PauseCommand,
    Phase,
    PhasedCommand,
    Reconciled,
    RefuseInstance,
    RenewLeaseCommand,
    ResumeCommand,
    Subjects,
    UnloadCommand,
    addressing_of,
    carried_load,
    command_decoder,
    encode,
    phase_of,
    tag_of,
)
from lorabus.signing import CommandVerifier

log = logging.getLogger(__name__)

_REMEMBERED_ACKS = 256
_REMEMBERED_COHORTS = 64
_RESUME_ON_EXIT_S = 5.0
_STATE_READ_EVERY_S = 60.0
"""Reconnects trigger a read at once; this only bounds how long a committed
notice dropped on a live connection can go unnoticed."""
_RECONCILE_BUDGET_S = 60.0
_BAD_EVENTS_PER_S = 10
_LEADER_READ_TIMEOUT_S = 2.0
_LEADER_REREAD_S = 0.5
"""The leader record is read at most once per this, whoever asks: a flood of
forged epochs costs one KV read per interval."""
_STUCK_AFTER_FAILURES = 3
"""Failed reloads of the committed adapter after which the agent says, in its
heartbeat, that its engine will not converge on its own."""
_RETIRE_BUDGET_S = 10.0
"""Retiring is housekeeping: it must not hold the next pause up for long."""

_CommandKey = tuple[int, str, str]
_T = TypeVar("_T")


class _Work(msgspec.Struct):
    command: PhasedCommand
    received: float
    internal: str = ""
    """Why the agent queued this itself: ``reconcile``, ``lease`` or ``retire``;
    empty for bus commands."""


class _CommittedView(msgspec.Struct):
    """The part of the committed record an agent needs (the rank map is skipped
    unbuilt: at 1024 workers it is most of the record's 57 KB)."""

    served_name: str
    path: str
    version: int
    lineage: int = 0
    digest: str = ""


_COMMITTED_VIEW = msgspec.json.Decoder(_CommittedView)
_LEADER_RECORD = msgspec.json.Decoder(LeaderRecord)


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
    ) -> None:
        if heartbeat_s <= 0:
            raise ValueError("heartbeat interval must be > 0")
        self.subjects = subjects
        self.executor = executor
        self.worker_id = executor.worker_id
        self.heartbeat_s = heartbeat_s
        self.epoch_seen = 0
        self.max_pause_lease_s = max_pause_lease_s
        self.lease = PauseLease()
        self.committed: CommittedNotice | None = None
        self._queue: asyncio.Queue[_Work] = asyncio.Queue()
        self._queued: set[_CommandKey] = set()
        self._reconciled = asyncio.Event()
        self._reconciled.set()
        self._acks: OrderedDict[_CommandKey, Ack] = OrderedDict()
        self._cohorts: OrderedDict[tuple[int, str], None] = OrderedDict()
        """(epoch, update id) of the pauses this agent took, newest last: a
        successor that runs the same update again starts a cohort of its own."""
        self._state_stale = False
        """The fleet state in KV must be read again (a reconnect, a failed read)."""
        self._pause_received_at = 0.0
        self._announced = False
        """Its first heartbeat is out: from then on the coordinator may count it."""
        self._named_in_epoch = -1
        """The latest term whose leader sent this process a pause by name: it
        takes broadcast pauses of that term only (coordinator/lifecycle.py)."""
        self._beats = BeatPolicy()
        self._nc: NatsClient | None = None
        self.instance = secrets.token_hex(8)
        """This process's identity among agents that share a worker id."""
        self._refused: asyncio.Future[RefuseInstance] | None = None
        self._bad_events = PerSecond(_BAD_EVENTS_PER_S)
        self._leader_lock = asyncio.Lock()
        self._leader_read = (-1.0, 0)
        """(when, epoch) of the last read of the leader record."""
        self.verifier = verifier or CommandVerifier()
        self._leader_keys: dict[int, str] = {}
        """The signing key of each epoch's leader record this agent has read."""
        self._reconcile_failures = 0
        """Failed reloads of the committed adapter in a row."""
        self._reconcile_error = ("", "")
        """(served name, why) of the last failed reload."""
        self._committed_known = False
        """A read of the fleet's KV state since this process started showed what
        is committed (or that nothing is). Until then a committed notice may be
        an old one replayed, and is not taken: the next read is."""
        self._unreadable: dict[str, str] = {}
        """Fleet state records (by key) that did not decode at their latest
        read, and why: ignored, and said so in every heartbeat."""
        self._held: dict[str, Msg] = {}
        """Per subject, the newest command of an epoch the leader record did not
        show yet, checked once more after the next read of the record."""
        self._recheck = asyncio.Event()

    @classmethod
    def from_config(cls, config: AgentConfig, driver: EngineDriver) -> Agent:
        """The agent ``config`` describes, driving its engine through ``driver``."""
        return cls(
            Subjects(fleet=config.fleet, prefix=config.subject_prefix),
            CommandExecutor(
                config.worker_id, config.world_size, driver, adapter_roots=config.adapter_roots
            ),
            heartbeat_s=config.heartbeat_s,
            max_pause_lease_s=config.max_pause_lease_s,
            verifier=CommandVerifier(config.coordinator_keys, config.trust_file or None),
        )

    @property
    def ready(self) -> bool:
        return self.committed is None or self.committed.served_name in self.executor.adapters

    async def run(self, nc: NatsClient, ready: asyncio.Event | None = None) -> None:
        """Serve until cancelled; set ``ready`` once subscribed and announced."""
        self._nc = nc
        self._refused = asyncio.get_running_loop().create_future()
        subs = [
            await nc.subscribe(self.subjects.cmd(), cb=self._on_command),
            await nc.subscribe(self.subjects.cmd_worker(self.worker_id), cb=self._on_command),
        ]
        try:
            await nc.flush(timeout=5)
            await self._serve(ready)
        except* DuplicateWorker as refused:
            raise refused.exceptions[0] from None
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await self._resume_if_paused()

    async def _serve(self, ready: asyncio.Event | None) -> None:
        self._state_stale = not await self._read_fleet_state()
        await self._resume_at_start()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._stop_if_refused())
            tasks.create_task(self._command_loop())
            tasks.create_task(self._recheck_loop())
            tasks.create_task(self.lease.watch(self._on_lease_expired))
            # Converge before the first heartbeat, so the coordinator never
            # counts this worker while its engine lacks the committed adapter.
            self._reconcile_if_needed()
            await self._wait_reconciled()
            await self._beat()
            self._announced = True
            if ready is not None:
                ready.set()
            log.info(
                "worker=%s agent ready on fleet %s (event loop: %s)",
                self.worker_id,
                self.subjects.fleet,
                running_loop_name(),
            )
            tasks.create_task(self._heartbeat_loop())

    async def _stop_if_refused(self) -> None:
        assert self._refused is not None
        refusal = await self._refused
        raise DuplicateWorker(
            f"worker id {self.worker_id!r} is held by another live agent (instance "
            f"{refusal.holder!r}); this one (instance {self.instance!r}) stops. Give each "
            "agent its own --worker-id, or stop the other one first."
        )

    # -- the bus side --------------------------------------------------------

    async def _on_command(self, msg: Msg, *, may_hold: bool = True) -> None:
        try:
            command = command_decoder.decode(msg.data)
        except BadPayload as exc:
            log.warning(
                "worker=%s dropped a malformed command on %r: %s", self.worker_id, msg.subject, exc
            )
            if not self._bad_events.take():
                return
            await self._emit(
                BadMessage(
                    ts=time.time(),
                    source=self._source,
                    subject=msg.subject[:256],
                    error=str(exc)[:1024],
                    size=len(msg.data),
                )
            )
            return
        addressing = addressing_of(command, self.worker_id, self._cohorts)
        if addressing is None:
            return
        if self.verifier.required:
            key = await self._signing_key_of(command.epoch)
            if not key and may_hold and command.epoch >= self.epoch_seen:
                self._hold(msg)
                return
            refusal = self.verifier.check(key, command.epoch, msg.subject, msg.headers, msg.data)
            if refusal is not None:
                await self._refuse_unproven(command, refusal)
                return
        if addressing is Addressing.NAME and not self._names_this_process(command):
            # Before the epoch check: a captured command of an older term gets
            # no ``fenced`` ack either (its sender is long gone).
            await self._refuse_unproven(
                command,
                f"sent by name to instance {command.instance or '(none)'}, "
                f"not to this agent process ({self.instance})",
            )
            return
        if command.epoch < self.epoch_seen:
            await self._refuse(command)
            return
        if command.epoch > self.epoch_seen and not await self._leader_shows(command.epoch):
            if may_hold:
                self._hold(msg)
                return
            await self._refuse_unproven(
                command,
                f"epoch {command.epoch} is not in the fleet's leader record "
                f"(which shows {self.epoch_seen})",
            )
            return
        fleet_pause = isinstance(command, PauseCommand) and command.cohort
        if fleet_pause and not self._countable(command.epoch):
            # Checked and fenced like any command, but a broadcast pause is only
            # for workers the coordinator counts: one that a pause of its term
            # named, while it is ready (not starting up or converging). A pause
            # meant for it all the same comes again by name.
            return
        match command:
            case RefuseInstance(instance=instance):
                if instance == self.instance and self._refused and not self._refused.done():
                    self._refused.set_result(command)
            case RenewLeaseCommand(update_id=update_id, lease_s=lease_s):
                self.lease.renew(update_id, self._lease_length(lease_s))
            case CommittedNotice():
                if self._take_notice(command):
                    self._retire(command)
                    self._reconcile_if_needed()
            case PauseCommand():
                self._pause_received_at = now()
                if not command.cohort:
                    self._named_in_epoch = command.epoch
                self._join_cohort((command.epoch, command.update_id))
                await self._accept(command)
                if command.then_load is not None:
                    await self._accept_carried(command, command.then_load)
            case _:
                await self._accept(command)

    def _names_this_process(self, command: Command) -> bool:
        """Whether a command sent by name is for this agent process. One sent
        before this process started names another (or none, from a coordinator
        of wire version 4): after a restart, the first named command an agent
        takes was signed after every command of its epoch captured before, so
        the per-epoch sequence check refuses those too (docs/protocol.md,
        "Replays"). An agent that checks no signature takes one that names none
        (anyone may send it anything)."""
        if isinstance(command, RefuseInstance):
            return True  # names the process it stops; every other one ignores it
        if command.instance:
            return command.instance == self.instance
        return command.v < INSTANCE_BOUND_SINCE or not self.verifier.required

    def _hold(self, msg: Msg) -> None:
        """Keep ``msg`` to check once more after the next read of the leader
        record (only the newest per subject: a flood cannot grow this)."""
        self._held[msg.subject] = msg
        self._recheck.set()

    async def _recheck_loop(self) -> None:
        while True:
            await self._recheck.wait()
            self._recheck.clear()
            # The next read of the record is allowed only after the interval.
            await asyncio.sleep(max(0.0, self._leader_read[0] + _LEADER_REREAD_S - now()))
            held, self._held = self._held, {}
            for msg in held.values():
                try:
                    await self._on_command(msg, may_hold=False)
                except Exception:  # one bad command must not stop the agent
                    log.exception("worker=%s could not check a held command", self.worker_id)

    async def _leader_shows(self, epoch: int) -> bool:
        """Whether the fleet's leader record shows ``epoch`` (or a later one);
        adopt it if so. Reads are shared and spaced out, whoever asks."""
        if epoch > self.epoch_seen:
            await self._reread_leader(lambda: epoch <= self.epoch_seen)
        return epoch <= self.epoch_seen

    async def _reread_leader(self, settled: Callable[[], bool]) -> None:
        """Read the leader record unless ``settled()`` already holds; reads are
        shared and spaced out, however many commands ask."""
        if settled():  # every command of a known term: no lock to take
            return
        async with self._leader_lock:
            if settled() or now() - self._leader_read[0] < _LEADER_REREAD_S:
                return
            leader = await self._read_leader()
            self._leader_read = (now(), self.epoch_seen)
            if leader is not None:
                self._learn_leader(leader)

    def _learn_leader(self, leader: LeaderRecord) -> None:
        self._leader_keys[leader.epoch] = leader.signing_key
        while len(self._leader_keys) > _REMEMBERED_COHORTS:
            del self._leader_keys[min(self._leader_keys)]
        self.epoch_seen = max(self.epoch_seen, leader.epoch)

    async def _read_leader(self) -> LeaderRecord | None:
        assert self._nc is not None
        try:
            async with asyncio.timeout(_LEADER_READ_TIMEOUT_S):
                kv = await self._nc.jetstream().key_value(self.subjects.state_bucket())
                return await self._get_record(kv, "leader", _LEADER_RECORD)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("worker=%s could not read the leader record: %r", self.worker_id, exc)
            return None

    async def _get_record(
        self, kv: object, key: str, decoder: msgspec.json.Decoder[_T]
    ) -> _T | None:
        """The fleet state record ``key``; None when there is none, or when it
        does not decode: then it is ignored (this agent keeps what it knew),
        and said so, in its heartbeats and once in the trail."""
        value = await _get_entry(kv, key)
        if value is None:
            self._unreadable.pop(key, None)
            return None
        try:
            # Pinned to the fleet's keys, only a record the leader sealed counts.
            record = decoder.decode(self.verifier.open_record(key, value))
        except (msgspec.DecodeError, RecursionError, ValueError) as exc:
            await self._report_unreadable(key, str(exc)[:512], len(value))
            return None
        if self._unreadable.pop(key, None) is not None:
            log.warning("worker=%s the fleet state's %s record decodes again", self.worker_id, key)
        return record

    async def _report_unreadable(self, key: str, why: str, size: int) -> None:
        """Log and emit ``bad_message`` when ``key`` turns unreadable (or fails
        otherwise than before): a record read every minute, and on every new
        epoch, must not fill the trail with the same news."""
        if self._unreadable.get(key) == why:
            return
        self._unreadable[key] = why
        log.warning(
            "worker=%s ignores the fleet state's %s record, which does not decode or "
            "is not sealed by the fleet's key: %s",
            self.worker_id,
            key,
            why,
        )
        if not self._bad_events.take():
            return
        await self._emit(
            BadMessage(
                ts=time.time(),
                source=self._source,
                subject=f"$KV.{self.subjects.state_bucket()}.{key}"[:256],
                error=f"the fleet state's {key} record does not decode (or is not the "
                f"leader's); ignored: {why}"[:1024],
                size=size,
                epoch=self.epoch_seen,
            )
        )

    async def _signing_key_of(self, epoch: int) -> str:
        """The signing key the leader record of ``epoch`` names ("" if unknown)."""
        if epoch >= self.epoch_seen:
            await self._reread_leader(lambda: epoch in self._leader_keys)
        return self._leader_keys.get(epoch, "")

    async def _refuse_unproven(self, command: Command, reason: str) -> None:
        """A command whose sender is not proven: a forged or unsigned one, or one
        ahead of a leader record this agent cannot read yet. Dropped without an
        ack (a real leader re-sends to agents that have not acked)."""
        await self._report_refusal(command, reason)

    async def _report_refusal(self, command: Command, reason: str) -> None:
        """Log a refused command and emit ``command_refused``, at most
        ``_BAD_EVENTS_PER_S`` times a second (a flood of forgeries must not
        flood the trail)."""
        log.warning(
            "worker=%s update=%s refused %s of epoch %d: %s",
            self.worker_id,
            command.update_id,
            tag_of(command),
            command.epoch,
            reason,
        )
        if not self._bad_events.take():
            return
        await self._emit(
            CommandRefused(
                ts=time.time(),
                source=self._source,
                update_id=command.update_id,
                worker_id=self.worker_id,
                command=tag_of(command),
                epoch=command.epoch,
                epoch_seen=self.epoch_seen,
                reason=reason[:1024],
            )
        )

    def _join_cohort(self, key: tuple[int, str]) -> None:
        self._cohorts[key] = None
        self._cohorts.move_to_end(key)
        while len(self._cohorts) > _REMEMBERED_COHORTS:
            self._cohorts.popitem(last=False)

    async def _accept(self, command: PhasedCommand) -> None:
        """Queue ``command``, unless it is queued already; a command that already
        ran gets its ack again."""
        key = (command.epoch, command.update_id, tag_of(command))
        if key in self._queued:
            return
        done = self._acks.get(key)
        if done is not None:
            await self._publish_ack(done)
            return
        self._queued.add(key)
        self._queue.put_nowait(_Work(command=command, received=now()))

    async def _accept_carried(self, pause: PauseCommand, spec: LoadSpec) -> None:
        """The load a pause carries runs behind that pause (``_command_loop``):
        a copy of it sent on its own meanwhile is dropped as queued, and one
        that already ran gets its ack again."""
        key = (pause.epoch, pause.update_id, str(Phase.LOAD))
        done = self._acks.get(key)
        if done is not None:
            await self._publish_ack(done)
        elif (pause.epoch, pause.update_id, str(Phase.PAUSE)) in self._queued:
            self._queued.add(key)

    async def _refuse(self, command: Command) -> None:
        """A command of an older epoch: refused, and acked ``fenced`` so that a
        deposed coordinator learns why."""
        await self._report_refusal(command, f"it has seen epoch {self.epoch_seen}")
        if isinstance(command, RenewLeaseCommand | CommittedNotice | RefuseInstance):
            return
        await self._publish_ack(
            self._ack_of(
                command,
                ErrorInfo(
                    code=ErrorCode.FENCED,
                    message=f"{self.worker_id} refused {tag_of(command)} of epoch "
                    f"{command.epoch}: it has seen epoch {self.epoch_seen}",
                ),
            )
        )

    # -- the engine side -----------------------------------------------------

    async def _command_loop(self) -> None:
        while True:
            raise_if_cancelled()
            work = await self._queue.get()
            command = work.command
            if work.internal == "lease" and self.lease.state is LeaseState.HELD:
                continue  # a newer pause re-armed the lease meanwhile: it holds the engine
            if work.internal == "retire" and (
                self.executor.paused or self._pause_received_at > work.received
            ):
                # The next update goes first (an engine may refuse to unload while
                # paused); the next commit names these versions again.
                log.debug("worker=%s put off retiring for a pause", self.worker_id)
                continue
            if work.internal:
                budget = command.budget_s - (now() - work.received)
                ack = await self.executor.execute(command, budget, retire=work.internal == "retire")
                await self._after_internal(work, ack)
                continue
            if isinstance(command, PauseCommand) and command.then_load is not None:
                # At once, behind this engine's own pause: no other engine's pause
                # is waited for, and no second message is.
                await self._pause_then_load(command, command.then_load, work.received)
                continue
            await self._run(command, work.received)

    async def _pause_then_load(self, pause: PauseCommand, spec: LoadSpec, received: float) -> None:
        """Run ``pause``, then the load it carries. Asked to (``ack_hold_s``),
        hold an ok pause's ack and send it inside the load's; a load still
        running when the hold ends gets its pause acked on its own first. The
        hold counts from the pause's arrival and ends by half its budget: a
        pause that was slow or queued is acked before its deadline, never
        held past it."""
        load = carried_load(pause, spec)
        if spec.ack_hold_s <= 0:
            await self._run(pause, received)
            await self._run(load, now())
            return
        paused = await self._run(pause, received, publish=False)
        if not paused.ok:
            await self._publish_ack(paused)
            await self._run(load, now())  # refused: the engine is not paused
            return
        hold_s = min(spec.ack_hold_s, pause.budget_s / 2) - (now() - received)
        loading = asyncio.create_task(self._run(load, now(), publish=False))
        try:
            held, _ = await asyncio.wait({loading}, timeout=max(hold_s, 0.0))
            if not held:
                await self._publish_ack(paused)
            loaded = await loading
        finally:
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
        if held:
            loaded = msgspec.structs.replace(loaded, with_pause=True, pause_s=paused.duration_s)
        await self._publish_ack(loaded)

    async def _run(self, command: PhasedCommand, received: float, *, publish: bool = True) -> Ack:
        """Run a command from the bus and publish its ack (the record of it);
        ``publish`` False: the caller sends it."""
        key = (command.epoch, command.update_id, tag_of(command))
        done = self._acks.get(key)
        if done is not None:  # a copy queued while the first one ran
            self._queued.discard(key)
            if publish:
                await self._publish_ack(done)
            return done
        if isinstance(command, LoadCommand) and command.after_pause:
            refusal = self._unpaused_for(command)
            if refusal is not None:
                # Not remembered: a pause that comes after all may carry the load.
                self._queued.discard(key)
                refused = self._ack_of(command, refusal)
                if publish:
                    await self._publish_ack(refused)
                return refused
        # A resume has its whole budget whenever it runs: time spent queued
        # behind a load must not fail it and leave the engine paused.
        waited = 0.0 if isinstance(command, ResumeCommand) else now() - received
        ack = await self.executor.execute(command, command.budget_s - waited)
        self._queued.discard(key)
        self._acks[key] = ack
        while len(self._acks) > _REMEMBERED_ACKS:
            self._acks.popitem(last=False)
        match command:
            case PauseCommand(lease_s=lease_s) if ack.ok or self.executor.maybe_paused:
                self.lease.arm(command.update_id, self._lease_length(lease_s))
            case ResumeCommand() if ack.ok and not self.executor.maybe_paused:
                self.lease.release()
        if isinstance(command, ResumeCommand) and log.isEnabledFor(logging.INFO):
            # One line per update: its end, as this engine saw it.
            log.info(
                "worker=%s update=%s %s; engine serves %s",
                self.worker_id,
                command.update_id,
                "resumed" if ack.ok else f"resume failed: {ack.error}",
                ", ".join(self.executor.adapters) or "no adapter",
            )
            # After an unanswered pause the lease runs on past the resume:
            # when it runs out, one more resume undoes a pause that landed late.
        # The ack is the record: the audit stream keeps it, and the
        # coordinator learns the engine's state from it, so neither an
        # event nor a heartbeat repeats it.
        if publish:
            await self._publish_ack(ack)
        return ack

    def _unpaused_for(self, load: LoadCommand) -> ErrorInfo | None:
        """Why a load meant for an engine its update's pause paused cannot run
        here (None: it can). The coordinator sends one on its own only to a
        member that acked that pause: an agent that has not taken it lost it
        (it restarted)."""
        pause = self._acks.get((load.epoch, load.update_id, str(Phase.PAUSE)))
        if pause is None:
            why = "this agent has not taken that pause"
        elif (load.epoch, load.update_id, str(Phase.RESUME)) in self._queued:
            # The update ended before the load began (its pause failed
            # elsewhere): the resume must not wait behind it.
            why = "the update's resume came first"
        elif not pause.ok:
            why = pause.error.message if pause.error else "the pause failed"
        elif not self.executor.paused:
            why = "the engine is no longer paused"
        else:
            return None
        return ErrorInfo(
            code=ErrorCode.NOT_PAUSED,
            message=f"{self.worker_id} did not load {load.served_name!r}: its pause of "
            f"update {load.update_id} did not hold ({why})",
        )

    def _lease_length(self, asked_s: float) -> float:
        """The coordinator's lease within this agent's own bounds: no command can
        hold the engine longer than ``--max-pause-lease`` without a renewal, nor
        make it resume before a minimum (0 asks for the agent's maximum)."""
        if asked_s <= 0:
            return self.max_pause_lease_s
        return min(max(asked_s, MIN_PAUSE_LEASE_S), self.max_pause_lease_s)

    async def _after_internal(self, work: _Work, ack: Ack) -> None:
        if work.internal == "reconcile":
            self._reconciled.set()
            assert isinstance(work.command, LoadCommand)
            if ack.ok:
                self._reconcile_failures = 0
            else:
                self._reconcile_failures += 1
                message = ack.error.message if ack.error else "unknown error"
                self._reconcile_error = (work.command.served_name, message)
            await self._emit(
                Reconciled(
                    ts=time.time(),
                    source=self._source,
                    worker_id=self.worker_id,
                    served_name=work.command.served_name,
                    ok=ack.ok,
                    error=ack.error,
                    epoch=work.command.epoch,
                )
            )
        elif work.internal == "retire":
            await self._emit(
                CommandHandled(
                    ts=time.time(),
                    source=self._source,
                    update_id=work.command.update_id,
                    phase=phase_of(work.command),
                    worker_id=self.worker_id,
                    ok=ack.ok,
                    error=ack.error,
                    epoch=work.command.epoch,
                )
            )
            return  # housekeeping: the next regular beat reports the shorter list
        elif work.internal == "lease":
            if ack.ok:
                self.lease.release()
                self.executor.maybe_paused = False
            await self._emit(
                LeaseExpired(
                    ts=time.time(),
                    source=self._source,
                    update_id=work.command.update_id,
                    worker_id=self.worker_id,
                    resumed=ack.ok,
                    error=ack.error,
                    epoch=work.command.epoch,
                )
            )
        await self._beat()

    async def _on_lease_expired(self, update_id: str) -> None:
        log.warning(
            "worker=%s update=%s pause lease ran out: resuming the engine on its own",
            self.worker_id,
            update_id,
        )
        resume = ResumeCommand(
            update_id=update_id,
            targets=[self.worker_id],
            budget_s=_RECONCILE_BUDGET_S,
            epoch=self.epoch_seen,
        )
        self._queue.put_nowait(_Work(command=resume, received=now(), internal="lease"))

    # -- converging to the committed state -------------------------------------

    def _learn_committed(self, notice: CommittedNotice) -> bool:
        """Take ``notice`` unless what this agent knows is committed is newer."""
        # A reset starts a new lineage: its versions may be lower than before.
        if self.committed is None or (notice.lineage, notice.version) >= (
            self.committed.lineage,
            self.committed.version,
        ):
            self.committed = notice
            return True
        return False

    def _take_notice(self, notice: CommittedNotice) -> bool:
        """Whether a committed notice from the bus is news to act on. Only
        forward from what the fleet's KV showed: a replayed notice of an older
        commit changes nothing, so before any read has shown what is committed
        the agent reads again at its next beat instead of taking one."""
        if not self._committed_known:
            log.info(
                "worker=%s update=%s committed notice put off: the fleet state is not read yet",
                self.worker_id,
                notice.update_id,
            )
            self._state_stale = True
            return False
        return self._learn_committed(notice)

    def _retire(self, notice: CommittedNotice) -> None:
        """Unload the versions the fleet no longer keeps, behind whatever is queued."""
        keep = self.committed.served_name if self.committed is not None else ""
        names = [n for n in notice.retire if n in self.executor.adapters and n != keep]
        if not names:
            return
        unload = UnloadCommand(
            update_id=notice.update_id,
            targets=[self.worker_id],
            budget_s=_RETIRE_BUDGET_S,
            epoch=notice.epoch,
            names=names,
        )
        self._queue.put_nowait(_Work(command=unload, received=now(), internal="retire"))

    async def _read_fleet_state(self) -> bool:
        """Learn the committed adapter and the current epoch from the fleet's KV;
        False when the read failed (a fleet without state yet is no failure)."""
        assert self._nc is not None
        try:
            async with asyncio.timeout(5):
                kv = await self._nc.jetstream().key_value(self.subjects.state_bucket())
                committed = await self._get_record(kv, "committed", _COMMITTED_VIEW)
                leader = await self._get_record(kv, "leader", _LEADER_RECORD)
        except nats.js.errors.BucketNotFoundError:
            self._committed_known = True  # no fleet state yet: nothing is committed
            return True
        except (TimeoutError, nats.errors.Error) as exc:
            log.debug("worker=%s could not read the fleet state: %r", self.worker_id, exc)
            return False
        if "committed" not in self._unreadable:
            self._committed_known = True
        if leader is not None:
            self._learn_leader(leader)
        if committed is not None:
            self._learn_committed(
                CommittedNotice(
                    update_id="state",
                    targets=[self.worker_id],
                    budget_s=0,
                    epoch=self.epoch_seen,
                    served_name=committed.served_name,
                    path=committed.path,
                    version=committed.version,
                    lineage=committed.lineage,
                    digest=committed.digest,
                )
            )
        return True

    def _reconcile_if_needed(self) -> None:
        target = self.committed
        if target is None or self._reconciling or self.executor.paused:
            return
        if target.served_name in self.executor.adapters:
            return
        self._reconciled.clear()
        log.info("worker=%s loading the committed %s", self.worker_id, target.served_name)
        load = LoadCommand(
            update_id=f"reconcile-{target.version}",
            targets=[self.worker_id],
            budget_s=_RECONCILE_BUDGET_S,
            epoch=self.epoch_seen,
            served_name=target.served_name,
            path=target.path,
            # The bytes that were committed, not whatever the path holds now:
            # a directory rewritten since must not be served under the old name.
            digest=target.digest or None,
        )
        self._queue.put_nowait(_Work(command=load, received=now(), internal="reconcile"))

    @property
    def _reconciling(self) -> bool:
        return not self._reconciled.is_set()

    async def _wait_reconciled(self) -> None:
        """Bounded by the reconciling load's own budget."""
        await self._reconciled.wait()

    # -- heartbeats ----------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        # Liveness must not depend on how fast the engine answers: the engine
        # check runs in its own loop, and this one only ever publishes.
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._engine_check_loop())
            while True:
                raise_if_cancelled()
                await asyncio.sleep(self.heartbeat_s)
                beat = self._heartbeat()
                if self._beats.should_beat(beat):
                    await self._send_beat(beat)

    async def _engine_check_loop(self) -> None:
        assert self._nc is not None
        # Spread the fleet's periodic reads instead of all agents reading at once.
        next_state_read = now() + random.uniform(0.5, 1.0) * _STATE_READ_EVERY_S
        reconnects = self._nc.stats["reconnects"]
        while True:
            raise_if_cancelled()
            await asyncio.sleep(self.heartbeat_s)
            if self._nc.stats["reconnects"] != reconnects:
                # Notices may have been missed while disconnected; JetStream may
                # not answer yet, so the read is retried every beat until it does.
                reconnects = self._nc.stats["reconnects"]
                self._state_stale = True
            if self._state_stale or now() >= next_state_read:
                self._state_stale = not await self._read_fleet_state()
                next_state_read = now() + _STATE_READ_EVERY_S
            quiet_s = now() - self.executor.last_contact
            if self._queue.empty() and not self.executor.paused and quiet_s >= self.heartbeat_s:
                # An engine restart loses adapters: noticing it is what lets
                # the agent reload the committed one. While commands keep the
                # engine busy, the check waits for a quiet interval.
                seen = self._reported()
                with contextlib.suppress(Exception):
                    await self.executor.refresh()
                self._reconcile_if_needed()
                if self._reported() != seen:
                    # Tell the coordinator now; the heartbeat loop beats on its own.
                    await self._beat()

    def _countable(self, epoch: int) -> bool:
        return (
            epoch == self._named_in_epoch
            and self._announced
            and self.ready
            and not self._reconciling
        )

    def _unready_reason(self) -> str:
        """Why the engine will not converge, once reloading the committed
        adapter has failed ``_STUCK_AFTER_FAILURES`` times in a row."""
        if self.ready or self._reconcile_failures < _STUCK_AFTER_FAILURES:
            return ""
        return (
            f"loading the committed {self._reconcile_error[0]} failed "
            f"{self._reconcile_failures} times: {self._reconcile_error[1]}"
        )[:4096]

    def _unreadable_state(self) -> str:
        return "; ".join(f"{key}: {why}" for key, why in sorted(self._unreadable.items()))[:4096]

    def _reported(self) -> tuple[list[str], bool, str]:
        """What a heartbeat says of the engine that a check can change."""
        return (
            list(self.executor.adapters),
            self.ready and not self._reconciling,
            self._unready_reason(),
        )

    def _heartbeat(self) -> Heartbeat:
        ex = self.executor
        return Heartbeat(
            worker_id=self.worker_id,
            world_size=ex.world_size,
            engine=ex.driver.kind,
            adapters=list(ex.adapters),
            paused=ex.paused,
            interval_s=self.heartbeat_s,
            ready=self.ready and not self._reconciling,
            epoch_seen=self.epoch_seen,
            instance=self.instance,
            unready_reason=self._unready_reason(),
            unreadable_state=self._unreadable_state(),
        )

    async def _beat(self) -> None:
        await self._send_beat(self._heartbeat())

    async def _send_beat(self, beat: Heartbeat) -> None:
        if await self._publish(self.subjects.heartbeat(self.worker_id), encode(beat)):
            self._beats.beat_sent(beat)

    # -- leaving -------------------------------------------------------------

    async def _resume_at_start(self) -> None:
        """A predecessor that died (SIGKILL) may have left the engine paused, and
        no lease is held now: resuming an engine that runs is harmless."""
        try:
            async with asyncio.timeout(_RESUME_ON_EXIT_S):
                await self.executor.driver.resume()
        except Exception as exc:
            log.warning("worker=%s could not resume its engine at start: %s", self.worker_id, exc)
            return
        self.executor.paused = False
        await self._emit(
            EngineResumed(
                ts=time.time(),
                source=self._source,
                worker_id=self.worker_id,
                reason="agent start",
                epoch=self.epoch_seen,
            )
        )

    async def _resume_if_paused(self) -> None:
        """A stopping agent resumes its engine: nobody would be left to do it."""
        if not self.executor.paused:
            return
        try:
            async with asyncio.timeout(_RESUME_ON_EXIT_S):
                await self.executor.driver.resume()
            self.executor.paused = False
            log.warning("worker=%s resumed its engine on the way out", self.worker_id)
        except Exception as exc:
            log.error("worker=%s is stopping with its engine paused: %s", self.worker_id, exc)
            return
        await self._emit(
            EngineResumed(
                ts=time.time(),
                source=self._source,
                worker_id=self.worker_id,
                reason="agent stopping",
                epoch=self.epoch_seen,
            )
        )

    # -- publishing ----------------------------------------------------------

    def _ack_of(self, command: PhasedCommand, error: ErrorInfo) -> Ack:
        ex = self.executor
        return Ack(
            update_id=command.update_id,
            phase=phase_of(command),
            worker_id=self.worker_id,
            ok=False,
            world_size=ex.world_size,
            adapters=list(ex.adapters),
            paused=ex.paused,
            error=error,
            epoch=command.epoch,
            instance=self.instance,
        )

    async def _publish_ack(self, ack: Ack) -> None:
        if ack.instance != self.instance:
            ack = msgspec.structs.replace(ack, instance=self.instance)
        if await self._publish(self.subjects.ack(self.worker_id), encode(ack)):
            self._beats.ack_sent(ack)

    async def _emit(self, event: Event) -> None:
        await self._publish(self.subjects.agent_event(self.worker_id, tag_of(event)), encode(event))

    async def _publish(self, subject: str, payload: bytes) -> bool:
        """Whether ``payload`` went out (to the connection's buffer)."""
        assert self._nc is not None, "run() sets the connection before anything is published"
        try:
            await self._nc.publish(subject, payload)
        except Exception as exc:  # a closed or draining connection must not kill the loop
            log.warning("worker=%s could not publish on %s: %s", self.worker_id, subject, exc)
            return False
        return True

    @property
    def _source(self) -> str:
        return f"agent:{self.worker_id}"


async def _get_entry(kv: object, key: str) -> bytes | None:
    try:
        entry = await kv.get(key)  # type: ignore[attr-defined]
    except nats.js.errors.KeyNotFoundError:
        return None
    value: bytes | None = entry.value  # an expired key can come back without one
    return value
