"""The agent's heartbeats, and the checks of its engine and the fleet between them.

A heartbeat goes out every interval (unless an ack said it all already: see
:mod:`lorabus.agents.beats`), and at once after the agent's own work
(reconciling, a lease running out) and whenever a check changed what it says.
Liveness must not depend on how fast the engine answers, so the checks run in
a loop of their own: the fleet's state in KV (every adapter's commit point) is
read again after a reconnect and about once a minute, and the engine's list
after every interval without commands (an engine restart loses adapters),
with the engine's set-up while it has a problem
(:meth:`~lorabus.agents.executor.CommandExecutor.refresh`), so a worker whose
engine is restarted with the missing flag is ready within a beat.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

from lorabus.agents.beats import BeatPolicy
from lorabus.agents.bus import AgentBus
from lorabus.agents.command_queue import CommandQueue
from lorabus.agents.convergence import Convergence
from lorabus.agents.executor import CommandExecutor
from lorabus.agents.fencing import Fencing
from lorabus.runtime.cancellation import raise_if_cancelled
from lorabus.runtime.clock import now
from lorabus.schemas import Heartbeat, ResumeCommand
from lorabus.schemas.reports import MISSING_SHOWN

LATE_PAUSE = "late_pause"
"""The internal work that undoes a pause that may have landed after its resume."""
_LATE_PAUSE_RESUME_BUDGET_S = 30.0

_STATE_READ_EVERY_S = 60.0
"""Reconnects trigger a read at once; this only bounds how long a committed
notice dropped on a live connection can go unnoticed."""


class Heartbeats:
    """Builds and sends one agent's heartbeats."""

    def __init__(
        self,
        bus: AgentBus,
        executor: CommandExecutor,
        beats: BeatPolicy,
        fencing: Fencing,
        convergence: Convergence,
        queue: CommandQueue,
        *,
        interval_s: float,
        instance: str,
        labels: dict[str, str] | None = None,
    ) -> None:
        self._bus = bus
        self._executor = executor
        self._beats = beats
        self._fencing = fencing
        self._convergence = convergence
        self._queue = queue
        self._interval_s = interval_s
        self._instance = instance
        self._labels = dict(labels or {})

    async def beat(self) -> None:
        """Send a heartbeat now, whatever the policy would skip."""
        await self._bus.send_beat(self._heartbeat())

    async def run(self) -> None:
        """Beat every interval, and check the engine and the fleet in between."""
        # Liveness must not depend on how fast the engine answers: the engine
        # check runs in its own loop, and this one only ever publishes.
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._engine_check_loop())
            while True:
                raise_if_cancelled()
                await asyncio.sleep(self._interval_s)
                beat = self._heartbeat()
                if self._beats.should_beat(beat):
                    await self._bus.send_beat(beat)

    async def _engine_check_loop(self) -> None:
        # Spread the fleet's periodic reads instead of all agents reading at once.
        next_state_read = now() + random.uniform(0.5, 1.0) * _STATE_READ_EVERY_S
        reconnects = self._bus.reconnects
        while True:
            raise_if_cancelled()
            await asyncio.sleep(self._interval_s)
            if self._bus.reconnects != reconnects:
                # Notices may have been missed while disconnected; JetStream may
                # not answer yet, so the read is retried every beat until it does.
                reconnects = self._bus.reconnects
                self._convergence.mark_stale()
            if self._convergence.stale or now() >= next_state_read:
                await self._convergence.read_fleet_state()
                next_state_read = now() + _STATE_READ_EVERY_S
            ex = self._executor
            if self._queue.empty() and ex.maybe_paused and not ex.paused:
                # A pause whose answer never came may land after the resume:
                # resume again (a resume is idempotent) every beat until the
                # lease that pause armed runs out, so a late pause holds the
                # engine for a beat, not for the lease.
                self._resume_late_pause()
                continue
            quiet_s = now() - self._executor.last_contact
            if self._queue.empty() and not self._executor.paused and quiet_s >= self._interval_s:
                # An engine restart loses adapters: noticing it is what lets
                # the agent reload what the fleet serves. While commands keep
                # the engine busy, the check waits for a quiet interval.
                seen = self._reported()
                with contextlib.suppress(Exception):
                    await self._executor.refresh()
                self._convergence.reconcile_if_needed()
                if self._reported() != seen:
                    # Tell the coordinator now; the heartbeat loop beats on its own.
                    await self.beat()

    def _resume_late_pause(self) -> None:
        ex = self._executor
        self._queue.put_internal(
            ResumeCommand(
                update_id=LATE_PAUSE,
                targets=[ex.worker_id],
                budget_s=_LATE_PAUSE_RESUME_BUDGET_S,
                epoch=self._fencing.epoch_seen,
            ),
            LATE_PAUSE,
        )

    def _reported(self) -> tuple[list[str], bool, str, list[str]]:
        """What a heartbeat says of the engine that a check can change."""
        return (
            list(self._executor.adapters),
            self._convergence.settled,
            self._convergence.unready_reason(),
            [w.served_name for w in self._convergence.missing()],
        )

    def _heartbeat(self) -> Heartbeat:
        ex = self._executor
        return Heartbeat(
            worker_id=ex.worker_id,
            world_size=ex.world_size,
            engine=ex.driver.kind,
            adapters=list(ex.adapters),
            # Until a pause that may land late cannot any more, the engine may
            # be paused whatever the agent last did.
            paused=ex.paused or ex.maybe_paused,
            interval_s=self._interval_s,
            ready=self._convergence.settled,
            epoch_seen=self._fencing.epoch_seen,
            instance=self._instance,
            unready_reason=self._convergence.unready_reason(),
            unreadable_state=self._fencing.unreadable_state(),
            missing=[w.served_name for w in self._convergence.missing()][:MISSING_SHOWN],
            capacity=ex.capacity,
            labels=self._labels,
            role=ex.role,
            data_parallel=ex.data_parallel,
        )
