"""Applying a fault schedule to a chaos fleet, and healing what it broke.

Each fault is applied at its offset from the start of the run and healed
``hold_s`` later (a killed process is replaced, a stopped one continued, an
engine fault cleared), or at once when the run ends and :meth:`heal` is
called. Each fault lands in its own task, so one that waits (for an update to
pause the engines, for the leader to be found, for the fault before it on its
target) delays no other: at a high fault rate the timetable holds. Faults on
one target still land one after the other, each after the last one's
recovery. Landings and recoveries are tasks owned by the injector: :meth:`run`
waits for every landing, :meth:`heal` runs every recovery to completion,
:meth:`aclose` (on an abort) cancels them and leaves the rest to the fleet's
own clean-up.

A frozen-leader request holds the control target until its one call has
returned (not only until SIGCONT), so that no nats-server restart or other
leader fault lands under a call that the invariants judge as made only while
the leader was frozen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import nats.errors

from lorabus.client import UpdateClient
from lorabus.errors import NoCoordinator
from lorabus.simfleet import SimWorker
from lorabus.testbed.chaos.fleet import ChaosFleet
from lorabus.testbed.chaos.schedule import Fault, FaultKind
from lorabus.testbed.chaos.timeline import COORDINATOR_PARTITIONED, now

log = logging.getLogger(__name__)

_FIND_LEADER_S = 3.0
_IN_PAUSE_WAIT_S = 5.0

Recovery = Callable[[], Awaitable[None]]
OneCallRequest = Callable[[str], Coroutine[Any, Any, object]]
"""Asks for an update with one client call while the named coordinator is
frozen, and records the outcome itself (``UpdateLoop.request_once``)."""


async def _nothing() -> None:
    return None


class FaultInjector:
    def __init__(
        self,
        fleet: ChaosFleet,
        schedule: list[Fault],
        client: UpdateClient,
        out: Callable[[str], None],
        *,
        request_once: OneCallRequest | None = None,
        stop_after: int | None = None,
    ) -> None:
        self.fleet = fleet
        self.schedule = schedule
        self.client = client
        self.out = out
        self.request_once = request_once
        self.stop_after = stop_after
        """Apply no more faults once this many have been injected."""
        self.injected: list[Fault] = []
        self.skipped: list[tuple[Fault, str]] = []
        self._heal_now = asyncio.Event()
        self._recoveries: set[asyncio.Task[None]] = set()
        self._requests: set[asyncio.Task[object]] = set()
        self._holding: dict[str, asyncio.Task[None]] = {}
        """By target: the recovery of the last fault applied to it."""
        self._landing: dict[str, asyncio.Task[None]] = {}
        """By target: the landing of the last fault scheduled on it."""

    @property
    def enough(self) -> bool:
        return self.stop_after is not None and len(self.injected) >= self.stop_after

    async def run(self, started_at: float) -> None:
        """Land every fault at its offset from ``started_at``, or until ``stop_after``
        have been injected; return when every landing is done (recoveries run on)."""
        async with asyncio.TaskGroup() as landings:
            for fault in self.schedule:
                # The schedule is a timetable: waiting for a time, not a condition.
                await asyncio.sleep(max(0.0, started_at + fault.at_s - now()))
                if self.enough:
                    break
                before = self._landing.get(fault.occupies)
                self._landing[fault.occupies] = landings.create_task(
                    self._land(fault, before), name=f"land-{fault.kind}"
                )

    async def _land(self, fault: Fault, before: asyncio.Task[None] | None) -> None:
        if before is not None:
            await before
        held = self._holding.get(fault.occupies)
        if held is not None:
            # A fault that landed late (waiting for a pause) may still hold
            # this target: one fault per target at a time, in real time too.
            await asyncio.shield(held)
        if fault.in_pause:
            await self._wait_paused(fault)
        if self.enough:
            return
        try:
            recover = await self._apply(fault)
        except Exception as exc:
            log.exception("applying %s failed", fault.describe())
            self._skip(fault, f"{type(exc).__name__}: {exc}")
            return
        if recover is None:
            return
        self.injected.append(fault)
        self.out(f"fault  {fault.describe()}")
        task = asyncio.create_task(self._hold(fault, recover), name=f"heal-{fault.kind}")
        self._recoveries.add(task)
        self._holding[fault.occupies] = task

    async def heal(self) -> None:
        """Heal every fault now, and whatever else still holds."""
        self._heal_now.set()
        await asyncio.gather(*self._recoveries)
        self._recoveries.clear()
        await self.fleet.heal()

    async def aclose(self) -> None:
        tasks = [*self._recoveries, *self._requests]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._recoveries.clear()
        self._requests.clear()

    async def _hold(self, fault: Fault, recover: Recovery) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._heal_now.wait(), fault.hold_s)
        try:
            await recover()
        except Exception:
            # The fleet's heal() retries whatever is still open.
            log.exception("healing %s failed", fault.describe())

    def _skip(self, fault: Fault, why: str) -> None:
        self.skipped.append((fault, why))
        self.out(f"skip   {fault.describe()}: {why}")

    async def _apply(self, fault: Fault) -> Recovery | None:
        fleet, worker_id = self.fleet, fault.target
        match fault.kind:
            case FaultKind.AGENT_KILL:
                await fleet.kill_agent(worker_id)
                return lambda: fleet.restart_agent(worker_id)
            case FaultKind.AGENT_STOP:
                fleet.stop_agent(worker_id)
                return _sync(lambda: fleet.continue_agent(worker_id))
            case FaultKind.COORDINATOR_KILL:
                holder = await self._find_leader()
                if holder is None:
                    self._skip(fault, "no running leader found")
                    return None
                await fleet.kill_coordinator(holder)
                return fleet.replace_coordinator
            case FaultKind.COORDINATOR_STOP:
                holder = await self._find_leader()
                if holder is None:
                    self._skip(fault, "no running leader found")
                    return None
                fleet.stop_coordinator(holder)
                return _sync(lambda: fleet.continue_coordinator(holder))
            case FaultKind.FROZEN_LEADER_REQUEST:
                return await self._frozen_leader_request(fault)
            case FaultKind.AGENT_PARTITION:
                # The target's agent process: with node agents, its whole node's.
                fleet.partition_agent(
                    worker_id,
                    to_bus=fault.cut in ("both", "to_bus"),
                    from_bus=fault.cut in ("both", "from_bus"),
                )
                return _sync(lambda: fleet.heal_agent_partition(worker_id))
            case FaultKind.LEADER_PARTITION:
                leader = await self._find_leader()
                if leader is None:
                    self._skip(fault, "no running leader found")
                    return None
                return self._partition(
                    fault, f"coordinator-{leader}", COORDINATOR_PARTITIONED, leader
                )
            case FaultKind.NATS_RESTART:
                node = fleet.faultable_node()
                await fleet.stop_nats(node)
                return lambda: fleet.start_nats(node)
            case FaultKind.NATS_NODE_PARTITION:
                if not fleet.clustered:
                    self._skip(fault, "a node partition needs a nats-server cluster")
                    return None
                node = fleet.faultable_node()
                fleet.cut_off_node(node)
                return _sync(lambda: fleet.reconnect_node(node))
            case FaultKind.ENGINE_LATENCY:
                fleet.slow_engine(worker_id, fault.latency_s)
                return _sync(lambda: fleet.unslow_engine(worker_id))
            case FaultKind.ENGINE_ERROR:
                fleet.fail_loads(worker_id, fault.fail_loads)
                return _sync(lambda: fleet.stop_failing_loads(worker_id))
            case FaultKind.ENGINE_HANG:
                fleet.hang_engine(worker_id)
                return _sync(lambda: fleet.unhang_engine(worker_id))
            case FaultKind.ENGINE_RESTART:
                fleet.restart_engine(worker_id)
                return _nothing
        raise ValueError(f"unknown fault kind {fault.kind}")

    async def _frozen_leader_request(self, fault: Fault) -> Recovery | None:
        """Freeze the leader, then start one update call; continue it after the
        hold, and hold the control target until that call has returned."""
        request_once = self.request_once
        if request_once is None:
            self._skip(fault, "this run makes no one-call requests")
            return None
        holder = await self._find_leader()
        if holder is None:
            self._skip(fault, "no running leader found")
            return None
        fleet = self.fleet
        fleet.stop_coordinator(holder)
        asking = asyncio.create_task(request_once(holder), name="frozen-leader-request")
        self._requests.add(asking)
        asking.add_done_callback(self._requests.discard)

        async def recover() -> None:
            fleet.continue_coordinator(holder)
            await asking

        return recover

    def _partition(self, fault: Fault, process: str, kind: str, subject: str) -> Recovery:
        fleet = self.fleet
        fleet.partition(
            process,
            kind,
            subject,
            to_bus=fault.cut in ("both", "to_bus"),
            from_bus=fault.cut in ("both", "from_bus"),
        )
        return _sync(lambda: fleet.heal_partition(process, kind, subject))

    async def _wait_paused(self, fault: Fault) -> None:
        """Until an update pauses the target's engine (any engine for control
        faults), for at most a few seconds: then the fault lands anyway."""
        workers = self.fleet.sim.workers
        watched = [workers[fault.target]] if fault.target in workers else list(workers.values())
        waits = [asyncio.ensure_future(_until_paused(w)) for w in watched]
        try:
            await asyncio.wait(waits, timeout=_IN_PAUSE_WAIT_S, return_when=FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def _find_leader(self) -> str | None:
        """The running leader: the one answering status, else from its leader_elected event."""
        deadline = now() + _FIND_LEADER_S
        while now() < deadline:
            with contextlib.suppress(NoCoordinator, nats.errors.Error):
                status = await self.client.status(timeout_s=0.5)
                child = self.fleet.coordinators.get(status.leader)
                if child is not None and child.running:
                    return status.leader
            holder = self.fleet.leader()
            if holder is not None:
                return holder
            await asyncio.sleep(0.1)
        return None


async def _until_paused(worker: SimWorker) -> bool:
    return await worker.wait_until(lambda: worker.paused)


def _sync(action: Callable[[], None]) -> Recovery:
    async def run() -> None:
        action()

    return run
