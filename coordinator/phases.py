"""One phase of an update on the bus: a command goes out, its acks come back.

A term's commands (:class:`Commands`) carry its epoch and are each one small
broadcast, signed once. A pause goes to the members that took a pause of
this term already (an agent acts on a broadcast pause only then), less the
others of them, and by name, each on its own subject, to the members that
did not (a term's first update, an agent that restarted); every later phase
goes to the pause's cohort (the agents that took it, less the members left
out). Acks are gathered against the membership snapshot with a deadline,
and members that have not acked get the command again on their own subject,
naming them, with a doubling interval (core NATS may have dropped it). No
message lists the membership (only the workers left out), so what each
agent reads stays about the same at any fleet size. Members that stop
heartbeating are given up on at once rather than at the deadline. When a
phase wakes, gives members up, sends again or ends (and how a stall of this
process is kept from passing for its members' silence) is the rule of
``deadline.py``, a pure function of the clock; here is the I/O it decides.

What a phase ended with is one :class:`PhaseOutcome`; what the update does
about it is ``update_run.py``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from lorabus.adapters.bus_paths import digest_of
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.deadline import PhaseDeadline
from lorabus.coordinator.gather import PhaseGather
from lorabus.coordinator.membership import Membership
from lorabus.coordinator.metrics import CoordinatorMetrics
from lorabus.coordinator.ports import CommandBus
from lorabus.runtime.cancellation import raise_if_cancelled
from lorabus.runtime.clock import now
from lorabus.schemas import (
    Ack,
    CanaryCommand,
    ErrorCode,
    ErrorInfo,
    LoadCommand,
    LoadSpec,
    PauseCommand,
    Phase,
    PhasedCommand,
    PhaseFinished,
    PrepareCommand,
    RenewLeaseCommand,
    ResumeCommand,
    UnloadCommand,
    phase_of,
)

log = logging.getLogger(__name__)

_C = TypeVar(
    "_C", PrepareCommand, PauseCommand, LoadCommand, ResumeCommand, UnloadCommand, CanaryCommand
)


class PhaseOutcome(msgspec.Struct, kw_only=True):
    phase: Phase
    acks: dict[str, Ack]
    missing: list[str]
    """Members that did not ack before the deadline."""
    lost: list[str]
    """Members that stopped heartbeating while the phase ran."""
    duration_s: float
    timeout_s: float

    @property
    def failed(self) -> list[str]:
        return sorted(wid for wid, ack in self.acks.items() if not ack.ok)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.lost and not self.failed

    def worker_errors(self) -> dict[str, ErrorInfo]:
        errors: dict[str, ErrorInfo] = {}
        for wid in self.failed:
            error = self.acks[wid].error
            errors[wid] = error or ErrorInfo(code=ErrorCode.ENGINE_ERROR, message="failed")
        for wid in self.missing:
            errors[wid] = ErrorInfo(
                code=ErrorCode.PHASE_TIMEOUT,
                message=f"no {self.phase} ack within {self.timeout_s:.1f}s",
            )
        for wid in self.lost:
            errors[wid] = ErrorInfo(
                code=ErrorCode.PHASE_TIMEOUT,
                message=f"agent stopped heartbeating during {self.phase}",
            )
        return errors

    def among(self, members: list[str]) -> PhaseOutcome:
        """This outcome for ``members`` alone (a load for those whose pause held)."""
        kept = set(members)
        return msgspec.structs.replace(
            self,
            acks={wid: ack for wid, ack in self.acks.items() if wid in kept},
            missing=[wid for wid in self.missing if wid in kept],
            lost=[wid for wid in self.lost if wid in kept],
        )

    def summary(self) -> ErrorInfo:
        errors = self.worker_errors()
        code = ErrorCode.WORKER_FAILED if self.failed else ErrorCode.PHASE_TIMEOUT
        if self.phase is Phase.RESUME:
            code = ErrorCode.RESUME_FAILED
        elif self.phase is Phase.CANARY and self.failed:
            code = ErrorCode.CANARY_FAILED
        details = "; ".join(f"{wid}: {err.message}" for wid, err in sorted(errors.items())[:10])
        more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
        return ErrorInfo(
            code=code,
            message=f"{self.phase} failed on {len(errors)} worker(s): {details}{more}",
        )


@dataclass(frozen=True)
class Gathering:
    """How a phase's acks are gathered, beyond the defaults."""

    opened: PhaseGather | None = None
    """The gather, opened by the caller (before a command that carries this one)."""
    sent: bool = False
    """The command went out already, carried by another: only re-sends follow."""
    resend_if: Callable[[str], bool] | None = None
    """Which stragglers may get it again (default: all)."""
    counted_from: Callable[[], float] = lambda: 0.0
    """When the phase's time starts, if later than its gather (monotonic)."""


class Commands:
    """A term's commands: each stamped with its epoch, sent, and its acks gathered.

    One per term, as what it remembers holds for one term only: which
    agents took a pause of this term (they take its broadcast pauses), and
    which were ever named in one (any of them may act on a broadcast pause,
    so those not in an update are excluded from it).
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        membership: Membership,
        bus: CommandBus,
        metrics: CoordinatorMetrics,
        epoch: int,
    ) -> None:
        self.config = config
        self.membership = membership
        self.bus = bus
        self.metrics = metrics
        self.epoch = epoch
        self._paused_this_term: dict[str, str] = {}
        """Worker id -> the agent instance that acked a pause of this term: it
        takes the term's broadcast pauses (agents/agent.py)."""
        self._named_this_term: set[str] = set()
        """Every worker sent a pause by name in this term."""

    def named(self, kind: type[_C], update_id: str, targets: list[str], **fields: Any) -> _C:
        """A command addressed to ``targets`` by name."""
        return kind(
            update_id=update_id,
            targets=targets,
            budget_s=self.config.phase_timeout_s,
            epoch=self.epoch,
            **fields,
        )

    def cohort(
        self, kind: type[_C], update_id: str, targets: list[str], among: list[str], **fields: Any
    ) -> _C:
        """A command addressed to ``targets`` as a cohort, less the rest of
        ``among``: for a pause, every worker a pause of this term named; for a
        later phase, the pause's targets."""
        kept = set(targets)
        return kind(
            update_id=update_id,
            cohort=True,
            excluded=[wid for wid in among if wid not in kept],
            budget_s=self.config.phase_timeout_s,
            epoch=self.epoch,
            **fields,
        )

    async def pause(
        self,
        update_id: str,
        targets: list[str],
        *,
        then_load: LoadSpec | None = None,
        opened: PhaseGather | None = None,
        shared_with: Sequence[str] = (),
    ) -> PhaseOutcome:
        """One broadcast to the targets that took a pause of this term, by name
        to the others; each carries the load ``then_load``, if any
        (``opened``: the pause's gather, opened by the caller), and names the
        updates it shares the pause with (``shared_with``).

        An agent takes a broadcast pause only once a pause of that term named
        it, so only workers this coordinator counted act on one, and the
        broadcast excludes those it does not count now. At N = 1024 the 1024
        signed publishes of a pause by name were about a seventh of the
        coordinator's CPU per update; now only a term's first update, and a
        member's first update after it (re)started, pay for theirs.
        """
        # A worker forgotten (silent for many beats) starts over, by name.
        for worker_id in [w for w in self._named_this_term if not self.membership.remembers(w)]:
            self._named_this_term.discard(worker_id)
            self._paused_this_term.pop(worker_id, None)
        took = self._paused_this_term
        by_name = [w for w in targets if took.get(w) != self.membership.instance_of(w)]
        named = set(by_name)
        broadcast_to = [w for w in targets if w not in named]
        # Every agent a pause of this term named may act on the broadcast, whether
        # or not its ack came back: those not in this update are excluded.
        command = self.cohort(
            PauseCommand,
            update_id,
            broadcast_to,
            sorted(self._named_this_term | named),
            lease_s=self.config.pause_lease_s,
            then_load=then_load,
            shared_with=list(shared_with),
        )
        pause = await self.phase(command, targets, by_name=by_name, gather=Gathering(opened=opened))
        for worker_id, ack in pause.acks.items():
            if ack.ok:  # a failed one is named again: it may not have taken it
                took[worker_id] = ack.instance
        return pause

    async def prepare(self, update_id: str, targets: list[str], path: str) -> PhaseOutcome:
        """Every target fetches the adapter at ``path`` (``bus:<digest>``) into
        its node's cache: one broadcast opening the update's cohort, by name
        again to stragglers, under ``--prepare-timeout``."""
        command = self.cohort(
            PrepareCommand, update_id, targets, targets, path=path, digest=digest_of(path)
        )
        budget = msgspec.structs.replace(command, budget_s=self.config.prepare_timeout_s)
        return await self.phase(budget, targets)

    async def phase(
        self,
        command: PhasedCommand,
        expected: list[str],
        *,
        first_ok: asyncio.Event | None = None,
        by_name: list[str] | None = None,
        gather: Gathering | None = None,
    ) -> PhaseOutcome:
        """Send ``command`` and gather the acks of ``expected`` (its addressees;
        ``by_name``, those of them a cohort command cannot reach); the phase is
        measured and its end is an event."""
        outcome = await self._gather(
            command, expected, first_ok, by_name or [], gather or Gathering()
        )
        self._measure(outcome)
        await self.bus.emit(
            PhaseFinished(
                ts=time.time(),
                source="coordinator",
                update_id=command.update_id,
                phase=outcome.phase,
                ok=outcome.ok,
                duration_s=outcome.duration_s,
                missing=sorted(outcome.missing + outcome.lost),
                failed=outcome.failed,
                epoch=self.epoch,
            )
        )
        if not outcome.ok:
            log.warning("update=%s %s", command.update_id, outcome.summary().message)
        return outcome

    async def renew_leases(self, update_id: str) -> None:
        """While the pause window lasts, keep the agents' pause leases from running out."""
        lease = self.config.pause_lease_s
        while True:
            raise_if_cancelled()
            await asyncio.sleep(lease / 3)
            await self.bus.broadcast(
                RenewLeaseCommand(
                    update_id=update_id,
                    cohort=True,
                    budget_s=0.0,
                    epoch=self.epoch,
                    lease_s=lease,
                )
            )

    def _measure(self, outcome: PhaseOutcome) -> None:
        self.metrics.phase_seconds.labels(outcome.phase).observe(outcome.duration_s)
        failed = len(outcome.failed)
        for label, count in (
            ("ok", len(outcome.acks) - failed),
            ("failed", failed),
            ("missing", len(outcome.missing) + len(outcome.lost)),
        ):
            if count:
                self.metrics.acks.labels(outcome.phase, label).inc(count)

    async def _gather(
        self,
        command: PhasedCommand,
        expected: list[str],
        first_ok: asyncio.Event | None,
        by_name: list[str],
        how: Gathering,
    ) -> PhaseOutcome:
        """Send ``command`` (unless ``how.sent``) and gather the acks of
        ``expected``. When to wake, give members up, send again or end is
        the rule of ``deadline.py``; this does the waiting, the looks at the
        membership and the sends."""
        phase = phase_of(command)
        gather = how.opened or self.bus.acks.expect(
            command.update_id, phase, expected, first_ok, command.epoch
        )
        started = now()
        times = PhaseDeadline.starting(started, command.budget_s)
        sent_at = dict.fromkeys(expected, started)
        looked_at = (-1, 0.0)  # membership generation, and quiet until when
        try:
            if not how.sent:
                await self._send_first(command, expected, by_name)
            while not gather.complete:
                raise_if_cancelled()
                at = now()
                planned = times.next_wake(at)
                if planned is None or await gather.wait(planned - at):
                    break
                at = now()
                times, wake = times.woke(planned, at)
                rejoined: list[str] = []
                # A look sees nothing new while the membership stays quiet.
                if wake.give_up_gone and not self.membership.still_quiet(*looked_at):
                    generation = self.membership.generation
                    gone, rejoined, quiet_until = self.membership.triage(gather.waiting, sent_at)
                    looked_at = (generation, quiet_until)
                    gather.give_up_on(gone)
                if wake.end:
                    break
                again_to = sorted(gather.waiting if wake.resend_all else rejoined)
                sent = await self._send_again(command, again_to, how, times.deadline - at)
                sent_at.update(dict.fromkeys(sent, at))
        finally:
            self.bus.acks.close(gather)
        return PhaseOutcome(
            phase=phase,
            acks=gather.acks,
            missing=sorted(gather.waiting),
            lost=sorted(gather.lost),
            duration_s=now() - max(started, how.counted_from()),
            timeout_s=command.budget_s,
        )

    async def _send_first(
        self, command: PhasedCommand, expected: list[str], by_name: list[str]
    ) -> None:
        """A cohort command as one broadcast to ``expected`` less ``by_name``
        and by name to ``by_name``; any other command by name to each."""
        if command.cohort and len(by_name) < len(expected):
            await self.bus.broadcast(command)
        named = by_name if command.cohort else expected
        if named:
            by_names = msgspec.structs.replace(command, cohort=False, excluded=[])
            await self._send_to_each(by_names, named)

    async def _send_again(
        self, command: PhasedCommand, worker_ids: list[str], how: Gathering, budget_s: float
    ) -> list[str]:
        """``command`` again to those of ``worker_ids`` that ``how.resend_if``
        lets have it, with ``budget_s`` left; return them. By name: a
        restarted agent has forgotten which pauses it took."""
        again_to = [w for w in worker_ids if how.resend_if is None or how.resend_if(w)]
        if again_to:
            again = msgspec.structs.replace(command, cohort=False, excluded=[], budget_s=budget_s)
            await self._send_to_each(again, again_to)
        return again_to

    async def _send_to_each(self, command: PhasedCommand, worker_ids: list[str]) -> None:
        """Each member on its own subject, named alone: a broadcast naming N
        members would have each of N agents read all N names. Each names the
        agent process it is for, as last heard: an agent refuses a named
        command for another process, so none captured before it started can
        drive it. A worker never heard has no known process: it is skipped,
        and gets the command once it beats (a member that joined after its
        command was sent gets it again at once)."""
        if isinstance(command, PauseCommand):
            self._named_this_term.update(worker_ids)
        for worker_id in worker_ids:
            instance = self.membership.instance_of(worker_id)
            if instance is None:
                log.debug("update=%s %s: no agent heard yet", command.update_id, worker_id)
                continue
            await self.bus.send_to(
                worker_id,
                msgspec.structs.replace(command, targets=[worker_id], instance=instance),
            )
