"""The queue between the bus and the engine, and the acks of what it ran.

A subscription callback only decodes, fences and enqueues: engine calls take
seconds and would stall every later message of that subscription. One task
(the agent's command loop) drains this queue, so commands for the engine run
one at a time, in arrival order; the agent's own work (reconciling, a lease
running out, retiring) waits in the same line.

Core NATS is at-most-once, so the coordinator re-sends commands to agents that
have not acked. A re-sent command is recognised by (epoch, update id, type):
if it already ran, its ack is published again; if it is queued, it is dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from lorabus.agents.bus import AgentBus
from lorabus.agents.config import MIN_PAUSE_LEASE_S
from lorabus.agents.executor import CommandExecutor
from lorabus.agents.lease import PauseLease
from lorabus.runtime.clock import now
from lorabus.schemas import (
    Ack,
    ErrorCode,
    ErrorInfo,
    LoadCommand,
    LoadSpec,
    PauseCommand,
    Phase,
    PhasedCommand,
    ResumeCommand,
    carried_load,
    tag_of,
)

# One logger name for all of the agent's lines: the one operators filter on.
log = logging.getLogger("lorabus.agents.agent")

_REMEMBERED_ACKS = 256

_CommandKey = tuple[int, str, str]


class Work(msgspec.Struct):
    command: PhasedCommand
    received: float
    internal: str = ""
    """Why the agent queued this itself: ``reconcile``, ``lease`` or ``retire``;
    empty for bus commands."""


class CommandQueue:
    """The engine's work in order, and the acks of the commands it ran."""

    def __init__(
        self,
        bus: AgentBus,
        executor: CommandExecutor,
        lease: PauseLease,
        *,
        max_pause_lease_s: float,
        late_pause_s: float = 0.0,
    ) -> None:
        self._bus = bus
        self._executor = executor
        self._worker_id = executor.worker_id
        self._lease = lease
        self._max_pause_lease_s = max_pause_lease_s
        self._late_pause_s = late_pause_s
        """How long after it was given up a pause may still land: the lease
        of an unanswered one runs longer by this, so that the agent's
        resumes at every beat (``heartbeats.py``) outlast it."""
        self._queue: asyncio.Queue[Work] = asyncio.Queue()
        self._queued: set[_CommandKey] = set()
        self._acks: OrderedDict[_CommandKey, Ack] = OrderedDict()
        self._deferred: list[Work] = []
        """Canaries held back until the engine runs again (:meth:`defer`)."""
        self._working = False
        self.on_idle: Callable[[], None] | None = None
        """Called whenever the agent puts its work down (a node's outbox waits for that)."""

    async def accept(self, command: PhasedCommand) -> None:
        """Queue ``command``, unless it is queued already; a command that already
        ran gets its ack again."""
        key = (command.epoch, command.update_id, tag_of(command))
        if key in self._queued:
            return
        done = self._acks.get(key)
        if done is not None:
            await self._bus.publish_ack(done)
            return
        self._queued.add(key)
        self._queue.put_nowait(Work(command=command, received=now()))

    async def accept_carried(self, pause: PauseCommand, spec: LoadSpec) -> None:
        """The load a pause carries runs behind that pause (:meth:`pause_then_load`):
        a copy of it sent on its own meanwhile is dropped as queued, and one
        that already ran gets its ack again."""
        key = (pause.epoch, pause.update_id, str(Phase.LOAD))
        done = self._acks.get(key)
        if done is not None:
            await self._bus.publish_ack(done)
        elif (pause.epoch, pause.update_id, str(Phase.PAUSE)) in self._queued:
            self._queued.add(key)

    def put_internal(self, command: PhasedCommand, why: str) -> None:
        """Queue work of the agent's own (``Work.internal``), behind whatever is queued."""
        self._queue.put_nowait(Work(command=command, received=now(), internal=why))

    async def next(self) -> Work:
        self._working = False
        if self.on_idle is not None and self._queue.empty():
            self.on_idle()
        work = await self._queue.get()
        self._working = True
        return work

    @property
    def idle(self) -> bool:
        """Nothing in hand nor queued (canaries held back for a resume aside)."""
        return not self._working and self._queue.empty()

    def defer(self, work: Work) -> None:
        """Hold a canary back while the engine is paused: a paused engine holds
        generations, and one waiting here would keep the resume of another
        update of its round (queued behind it) from ever running. It stays
        queued, so a copy sent again is dropped."""
        self._deferred.append(work)

    def undefer(self) -> None:
        """The engine runs again: the canaries held back go to the queue's end,
        their budgets counted from now."""
        for work in self._deferred:
            self._queue.put_nowait(msgspec.structs.replace(work, received=now()))
        self._deferred.clear()

    def empty(self) -> bool:
        return self._queue.empty()

    async def run_internal(self, work: Work) -> Ack:
        """Run the agent's own work, within what is left of its budget; its ack is
        not published (an event says how it went)."""
        budget = work.command.budget_s - (now() - work.received)
        return await self._executor.execute(work.command, budget, retire=work.internal == "retire")

    async def pause_then_load(self, pause: PauseCommand, spec: LoadSpec, received: float) -> None:
        """Run ``pause``, then the load it carries. Asked to (``ack_hold_s``),
        hold an ok pause's ack and send it inside the load's; a load still
        running when the hold ends gets its pause acked on its own first. The
        hold counts from the pause's arrival and ends by half its budget: a
        pause that was slow or queued is acked before its deadline, never
        held past it."""
        load = carried_load(pause, spec)
        if spec.ack_hold_s <= 0:
            await self.run(pause, received)
            await self.run(load, now())
            return
        paused = await self.run(pause, received, publish=False)
        if not paused.ok:
            await self._bus.publish_ack(paused)
            await self.run(load, now())  # refused: the engine is not paused
            return
        hold_s = min(spec.ack_hold_s, pause.budget_s / 2) - (now() - received)
        loading = asyncio.create_task(self.run(load, now(), publish=False))
        try:
            held, _ = await asyncio.wait({loading}, timeout=max(hold_s, 0.0))
            if not held:
                await self._bus.publish_ack(paused)
            loaded = await loading
        finally:
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
        if held:
            loaded = msgspec.structs.replace(loaded, with_pause=True, pause_s=paused.duration_s)
        await self._bus.publish_ack(loaded)

    async def run(self, command: PhasedCommand, received: float, *, publish: bool = True) -> Ack:
        """Run a command from the bus and publish its ack (the record of it);
        ``publish`` False: the caller sends it."""
        key = (command.epoch, command.update_id, tag_of(command))
        done = self._acks.get(key)
        if done is not None:  # a copy queued while the first one ran
            self._queued.discard(key)
            if publish:
                await self._bus.publish_ack(done)
            return done
        if isinstance(command, LoadCommand) and command.after_pause:
            refusal = self._unpaused_for(command)
            if refusal is not None:
                # Not remembered: a pause that comes after all may carry the load.
                self._queued.discard(key)
                refused = self._executor.refusal(command, refusal)
                if publish:
                    await self._bus.publish_ack(refused)
                return refused
        # A resume has its whole budget whenever it runs: time spent queued
        # behind a load must not fail it and leave the engine paused.
        waited = 0.0 if isinstance(command, ResumeCommand) else now() - received
        holding = self._shared(command)
        ack = await self._executor.execute(
            command, command.budget_s - waited, shared_pause=bool(holding)
        )
        self._queued.discard(key)
        self._acks[key] = ack
        while len(self._acks) > _REMEMBERED_ACKS:
            self._acks.popitem(last=False)
        match command:
            case PauseCommand(lease_s=lease_s) if ack.ok or self._executor.maybe_paused:
                lease_s = self.lease_length(lease_s)
                if not ack.ok:  # unanswered: the engine may still carry it out
                    lease_s += self._late_pause_s
                self._lease.arm(command.update_id, lease_s, command.shared_with, command.epoch)
            case ResumeCommand() if ack.ok and holding and self._executor.paused:
                self._lease.release(command.update_id)
            case ResumeCommand() if ack.ok and not self._executor.maybe_paused:
                self._lease.release()
        if isinstance(command, ResumeCommand) and log.isEnabledFor(logging.INFO):
            # One line per update: its end, as this engine saw it.
            if holding and ack.ok:
                outcome = f"resume held: the pause of {', '.join(holding)} holds the engine"
            else:
                outcome = "resumed" if ack.ok else f"resume failed: {ack.error}"
            log.info(
                "worker=%s update=%s %s; engine serves %s",
                self._worker_id,
                command.update_id,
                outcome,
                ", ".join(self._executor.adapters) or "no adapter",
            )
            # After an unanswered pause the lease runs on past the resume:
            # when it runs out, one more resume undoes a pause that landed late.
        # The ack is the record: the audit stream keeps it, and the
        # coordinator learns the engine's state from it, so neither an
        # event nor a heartbeat repeats it.
        if publish:
            await self._bus.publish_ack(ack)
        return ack

    def _shared(self, command: PhasedCommand) -> list[str]:
        """The other updates of ``command``'s round that hold the engine paused
        now: a pause of the round need not ask the engine again, and a resume
        leaves it paused for them (the last one's resumes it)."""
        match command:
            case ResumeCommand():
                return self._lease.held_by_others(command.update_id, command.epoch)
            case PauseCommand(shared_with=shared_with) if shared_with:
                mates = set(shared_with)
                holding = self._lease.held_by_others(command.update_id, command.epoch)
                return [u for u in holding if u in mates]
        return []

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
        elif not self._executor.paused:
            why = "the engine is no longer paused"
        else:
            return None
        return ErrorInfo(
            code=ErrorCode.NOT_PAUSED,
            message=f"{self._worker_id} did not load {load.served_name!r}: its pause of "
            f"update {load.update_id} did not hold ({why})",
        )

    def lease_length(self, asked_s: float) -> float:
        """The coordinator's lease within this agent's own bounds: no command can
        hold the engine longer than ``--max-pause-lease`` without a renewal, nor
        make it resume before a minimum (0 asks for the agent's maximum)."""
        if asked_s <= 0:
            return self._max_pause_lease_s
        return min(max(asked_s, MIN_PAUSE_LEASE_S), self._max_pause_lease_s)
