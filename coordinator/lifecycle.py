"""A term's updates: each one run to its result, and a predecessor's rolled back.

The coordinator makes one :class:`UpdateRunner` per term, with the term's
epoch: every command it sends carries that epoch, and what it remembers of
the agents (which took a pause of this term, ``phases.py``) holds for that
term alone. Each update is an :class:`~lorabus.coordinator.update_run.UpdateRun`
of its own, which returns one
:class:`~lorabus.coordinator.outcomes.RunOutcome`: quorum -> pause
(carrying the load) -> verify -> resume, or, in live mode, load -> verify.
A new leader's runner also finishes what a dead predecessor left in flight
(:meth:`UpdateRunner.roll_back`).

It sees the bus, the frontend and the in-flight journal only through the
small protocols of ``ports.py``, which tests implement in memory.
"""

from __future__ import annotations

import asyncio
import logging

from lorabus.coordinator.canary import PauseWindows
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.deadline import LIVENESS_TICK_S, first_resend_gap
from lorabus.coordinator.membership import Membership
from lorabus.coordinator.metrics import CoordinatorMetrics
from lorabus.coordinator.outcomes import RunOutcome
from lorabus.coordinator.phases import Commands
from lorabus.coordinator.placement import Served
from lorabus.coordinator.plan import UpdatePlan
from lorabus.coordinator.ports import CommandBus, Frontend, Journal
from lorabus.coordinator.update_run import UpdateRun
from lorabus.runtime.clock import now
from lorabus.schemas import (
    ErrorCode,
    ErrorInfo,
    InflightRecord,
    Phase,
    ResumeCommand,
    UnloadCommand,
)

log = logging.getLogger(__name__)


class UpdateRunner:
    def __init__(
        self,
        config: CoordinatorConfig,
        membership: Membership,
        frontend: Frontend,
        bus: CommandBus,
        journal: Journal,
        metrics: CoordinatorMetrics,
        *,
        epoch: int,
    ) -> None:
        self.placing: dict[str, Served] = {}
        """Update id -> where each placed update of this term that runs now
        loads its version: a placed update beside it counts those too."""
        self.pausing = PauseWindows()
        """The pause windows of this term's updates open now (a canary waits
        for the others' to close)."""
        self.frontend = frontend
        self.journal = journal
        self.commands = Commands(config, membership, bus, metrics, epoch)
        """The term's commands, stamped with its epoch."""

    async def run(self, plan: UpdatePlan) -> RunOutcome:
        """Run ``plan`` to a terminal result; never leaves a member told to pause
        unresumed. The writes of the in-flight record have ended by then
        (stored, or failed and logged): the caller may clear it."""
        return await UpdateRun(
            plan,
            self.commands,
            self.frontend,
            self.journal,
            placing=self.placing,
            pausing=self.pausing,
        ).run()

    async def roll_back(self, in_flight: InflightRecord) -> ErrorInfo:
        """Finish what a dead predecessor left: resume every member, withdraw the
        version it may have loaded, and describe the outcome."""
        commands = self.commands
        targets = sorted(in_flight.members)
        await self._wait_heard(targets)
        # By name: the agents' cohort memory may not have outlived the predecessor.
        resume = await commands.phase(
            commands.named(ResumeCommand, in_flight.update_id, targets), targets
        )
        if in_flight.phase is not Phase.PAUSE and in_flight.served_name != in_flight.adapter:
            unload = commands.named(
                UnloadCommand, in_flight.update_id, targets, names=[in_flight.served_name]
            )
            await commands.phase(unload, targets)
        resumed = "every member resumed" if resume.ok else resume.summary().message
        return ErrorInfo(
            code=ErrorCode.FAILOVER,
            message=f"the coordinator of epoch {in_flight.epoch} stopped mid-update (at or "
            f"after {in_flight.phase}); epoch {commands.epoch} rolled the update back "
            f"({resumed})",
        )

    async def _wait_heard(self, worker_ids: list[str]) -> None:
        """Until every one of ``worker_ids`` has beaten once, for at most a
        phase's first re-send gap: a leader that has just started may not have
        heard them yet, and a command by name names the agent process it is
        for. One still unheard then counts as gone, as before."""
        membership = self.commands.membership
        deadline = now() + first_resend_gap(self.commands.config.phase_timeout_s)
        unheard = [w for w in worker_ids if membership.instance_of(w) is None]
        while unheard and now() < deadline:
            await asyncio.sleep(LIVENESS_TICK_S)
            unheard = [w for w in unheard if membership.instance_of(w) is None]
        if unheard:
            log.warning("rolling back without word from %s: their agents were not heard", unheard)
