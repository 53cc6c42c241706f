"""The lifecycle of one update: quorum -> pause -> load -> verify -> resume.

Each phase is one small broadcast, signed once. The pause goes to the members
that took a pause of this term already (an agent acts on a broadcast pause
only then), less the others of them, and by name, each on its own subject,
to the members that did not (a term's first update, an agent that restarted);
every later phase goes to the pause's cohort (the agents that took it, less
the members left out). Acks are gathered against the membership snapshot
with a deadline, and members that have not acked get the command again on
their own subject, naming them, with a doubling interval (core NATS may have
dropped it). No message lists the membership (only the workers left out), so
what each agent reads stays about the same at any fleet size.
Members that stop heartbeating are given up on at once rather than at the
deadline. Resume runs in a ``finally``: whatever failed, every member that may
have paused is told to resume. Retiring versions beyond ``keep`` is not a
phase: the committed notice names them and each agent unloads them itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec

from lorabus.cancellation import raise_if_cancelled
from lorabus.clock import now
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.digests import agreed_digest, digest_problem
from lorabus.coordinator.gather import AckRouter, PhaseGather
from lorabus.coordinator.membership import Membership
from lorabus.coordinator.metrics import CoordinatorMetrics
from lorabus.coordinator.plan import UpdatePlan
from lorabus.errors import FrontendUnverified, QuorumNotReached
from lorabus.schemas import (
    COMMITTED,
    FAILED,
    Ack,
    Command,
    ErrorCode,
    ErrorInfo,
    Event,
    InflightRecord,
    LoadCommand,
    LoadSpec,
    PauseCommand,
    Phase,
    PhasedCommand,
    PhaseFinished,
    RankMap,
    RenewLeaseCommand,
    ResumeCommand,
    UnloadCommand,
    UpdateResult,
    UpdateStarted,
    WorkerOutcome,
    build_rank_map,
    phase_of,
)

log = logging.getLogger(__name__)

_C = TypeVar("_C", PauseCommand, LoadCommand, ResumeCommand, UnloadCommand)
_FIRST_RESEND_S = 1.0
"""A re-send only helps a member whose command was lost, and each costs a
signed publish per member still busy: engines answer a load in seconds, not
in this. So the first one waits an eighth of the phase's deadline, at least
this long (3.75 s of a 30 s phase), and the gap doubles after each. A member
that (re)joined after its command was sent (an agent starting, one cut off
from the bus for a beat) likely missed it: it gets it again at once."""
_FIRST_RESEND_SHARE = 1 / 8
_RECORDED_PHASES = (Phase.PAUSE, Phase.LOAD)
_LIVENESS_TICK_S = 0.25


class Journal(Protocol):
    """Where the update in flight is sent ahead of its pause (and its load), so
    that a successor finds it (the fleet's KV; a list in tests)."""

    async def record(self, in_flight: InflightRecord) -> None: ...


class Frontend(Protocol):
    """What the verify phase asks of the frontend (an HTTP client; a fake in tests)."""

    async def wait_listed(self, model: str, timeout_s: float) -> float:
        """Seconds until ``model`` was listed; raises FrontendUnverified at the deadline."""
        ...


class CommandBus(Protocol):
    """How commands go out and acks come back (core NATS; in memory in tests)."""

    acks: AckRouter

    async def broadcast(self, command: Command) -> None: ...

    async def send_to(self, worker_id: str, command: PhasedCommand) -> None: ...

    async def emit(self, event: Event) -> None: ...


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
        details = "; ".join(f"{wid}: {err.message}" for wid, err in sorted(errors.items())[:10])
        more = f" (and {len(errors) - 10} more)" if len(errors) > 10 else ""
        return ErrorInfo(
            code=code,
            message=f"{self.phase} failed on {len(errors)} worker(s): {details}{more}",
        )


@dataclass(frozen=True)
class _Gathering:
    """How a phase's acks are gathered, beyond the defaults."""

    opened: PhaseGather | None = None
    """The gather, opened by the caller (before a command that carries this one)."""
    sent: bool = False
    """The command went out already, carried by another: only re-sends follow."""
    resend_if: Callable[[str], bool] | None = None
    """Which stragglers may get it again (default: all)."""
    counted_from: Callable[[], float] = lambda: 0.0
    """When the phase's time starts, if later than its gather (monotonic)."""


@dataclass(frozen=True)
class _PauseFailed:
    """A pause that failed the update, while the loads it carried were under way."""

    error: ErrorInfo
    errors: dict[str, ErrorInfo]
    load: PhaseOutcome
    """What is known of the loads: acks so far, the rest missing."""


class UpdateRunner:
    def __init__(
        self,
        config: CoordinatorConfig,
        membership: Membership,
        frontend: Frontend,
        bus: CommandBus,
        journal: Journal,
        metrics: CoordinatorMetrics,
    ) -> None:
        self.config = config
        self.membership = membership
        self.frontend = frontend
        self.bus = bus
        self.journal = journal
        self.metrics = metrics
        self.epoch = 0
        """The term this runner commands in; every command carries it."""
        self._in_flight: InflightRecord | None = None
        self._recorded: Phase | None = None
        """The latest phase the in-flight record was written with, this update."""
        self._recording: list[asyncio.Task[bool]] = []
        """This update's writes of the in-flight record: :meth:`run` awaits them."""
        self.in_flight_stored: bool | None = None
        """After :meth:`run`: None if the update wrote no in-flight record (it
        ended before its first command), else whether every write of it landed."""
        self._may_have_loaded: set[str] = set()
        """Members left out of this update whose pause may still have landed,
        and with it the load it carried."""
        self._term_epoch = 0
        self._paused_this_term: dict[str, str] = {}
        """Worker id -> the agent instance that acked a pause of this term: it
        takes the term's broadcast pauses (agents/agent.py)."""
        self._named_this_term: set[str] = set()
        """Every worker sent a pause by name in this term: any of them may take
        a broadcast pause, so those not in an update are excluded from it."""

    async def run(self, plan: UpdatePlan) -> UpdateResult:
        """Run ``plan`` to a terminal result; never leaves a member told to pause
        unresumed. The writes of the in-flight record have ended by then
        (stored, or failed and logged): the caller may clear it."""
        self.in_flight_stored = None
        try:
            return await self._run(plan)
        finally:
            recording, self._recording = self._recording, []
            if recording:
                self.in_flight_stored = all(await asyncio.gather(*recording))

    async def _run(self, plan: UpdatePlan) -> UpdateResult:
        phases: dict[str, float] = {}
        started = now()
        try:
            members = await self.membership.wait_quorum(
                self.config.expected_world_size,
                self.config.quorum_timeout_s,
                needed=self._needed_world_size(),
                grace_s=self.config.quorum_grace_s,
            )
        except QuorumNotReached as exc:
            phases[Phase.QUORUM] = now() - started
            quorum_error = ErrorInfo(code=ErrorCode.QUORUM_TIMEOUT, message=str(exc))
            return self._result(plan, FAILED, phases, {}, None, quorum_error)
        phases[Phase.QUORUM] = now() - started
        await self.bus.emit(
            UpdateStarted(
                ts=time.time(),
                source="coordinator",
                update_id=plan.update_id,
                adapter=plan.served_name,
                version=plan.version,
                members=members,
                epoch=self.epoch,
            )
        )

        if plan.live:
            return await self._run_live(plan, members, phases)

        targets = sorted(members)
        """The pause's targets: every later command of this update addresses them."""
        errors: dict[str, ErrorInfo] = {}
        error: ErrorInfo | None = None
        load: PhaseOutcome | None = None
        serving: list[str] = []
        self._in_flight, self._recorded = self._in_flight_record(plan, members, Phase.PAUSE), None
        self._may_have_loaded = set()
        renewing = asyncio.create_task(self._renew_pause_leases(plan.update_id))
        paused_at = now()
        try:
            error, errors, load, serving = await self._pause_load_verify(plan, members, phases)
        finally:
            try:
                resume = await self._phase(
                    self._cohort_command(ResumeCommand, plan, targets, targets), targets, phases
                )
            finally:
                renewing.cancel()
                await asyncio.gather(renewing, return_exceptions=True)
                self.metrics.pause_window_seconds.observe(now() - paused_at)
            unresumed = resume.worker_errors()
            for wid, err in unresumed.items():
                errors.setdefault(wid, err)
            if unresumed and error is None:
                resumed = self._resumed(unresumed, serving, members)
                if resumed is None:
                    error = resume.summary()
                else:
                    serving = resumed
        if error is not None:
            await self._withdraw_uncommitted(plan, load, phases)
            return self._result(plan, FAILED, phases, members, load, error, errors)
        rank_map = build_rank_map({wid: members[wid] for wid in serving})
        return self._result(plan, COMMITTED, phases, members, load, None, errors, rank_map)

    def _in_flight_record(
        self, plan: UpdatePlan, members: dict[str, int], phase: Phase
    ) -> InflightRecord:
        """What a successor needs to undo this update, as of its first phase."""
        return InflightRecord(
            update_id=plan.update_id,
            epoch=self.epoch,
            phase=phase,
            adapter=plan.adapter,
            served_name=plan.served_name,
            version=plan.version,
            members=members,
            path=plan.path,
        )

    async def _run_live(
        self, plan: UpdatePlan, members: dict[str, int], phases: dict[str, float]
    ) -> UpdateResult:
        """Load and verify the new versioned name on every member while engines
        keep serving: nothing pauses, so there is nothing to resume; what did
        not commit is unloaded where it loaded, as in pause mode."""
        targets = sorted(members)
        self._in_flight, self._recorded = self._in_flight_record(plan, members, Phase.LOAD), None
        self._may_have_loaded = set()
        left_out: dict[str, ErrorInfo] = {}
        # Named targets, not a pause's cohort: no agent took a pause to join one.
        load, listed = await self._load(
            self._command(
                LoadCommand,
                plan,
                targets,
                served_name=plan.served_name,
                path=plan.path,
                replace=False,
                digest=plan.digest,
            ),
            targets,
            phases,
        )
        serving: list[str] | None = None
        error = digest_problem(plan.digest, load.acks)
        if error is None:
            serving = self._survivors(load, targets, members, left_out)
            if serving is None:
                error = load.summary()
            else:
                error = await self._verify(plan, load, serving, phases, listed)
        if error is not None or serving is None:
            await self._withdraw_uncommitted(plan, load, phases)
            errors = left_out | load.worker_errors()
            return self._result(plan, FAILED, phases, members, load, error, errors)
        rank_map = build_rank_map({wid: members[wid] for wid in serving})
        return self._result(plan, COMMITTED, phases, members, load, None, left_out, rank_map)

    async def _pause_load_verify(
        self, plan: UpdatePlan, members: dict[str, int], phases: dict[str, float]
    ) -> tuple[ErrorInfo | None, dict[str, ErrorInfo], PhaseOutcome | None, list[str]]:
        """Run the phases inside the pause; return the error, the workers left out
        (with why), the load outcome, and the members that serve the new version.

        The pause carries the load: each agent loads as soon as its own engine
        is paused, so the fleet's pause acks are no barrier before any load
        (one message and one round of the bus fewer per update). An agent
        whose pause failed refuses the load. A fixed-name load (``replace``)
        is not carried: it changes what the committed name serves, so it
        waits for the whole fleet's pause. A phase that fails on some members
        ends the update, unless the quorum policy allows going on without
        them: then they are left out.
        """
        left_out: dict[str, ErrorInfo] = {}
        targets = sorted(members)
        load_command = self._cohort_command(
            LoadCommand,
            plan,
            targets,
            targets,
            served_name=plan.served_name,
            path=plan.path,
            replace=plan.replace,
            digest=plan.digest,
            after_pause=True,
        )
        if plan.replace:
            pause = await self._pause(plan, targets, phases)
            paused = self._survivors(pause, targets, members, left_out)
            if paused is None:
                return pause.summary(), pause.worker_errors(), None, []
            kept = set(paused)
            excluded = [w for w in targets if w not in kept]
            load, listed = await self._load(
                msgspec.structs.replace(load_command, excluded=excluded), paused, phases
            )
        else:
            carried = await self._pause_carrying(plan, targets, members, load_command, phases)
            if isinstance(carried, _PauseFailed):
                return carried.error, carried.errors, carried.load, []
            paused, left_out, load, listed = carried
        mismatch = digest_problem(plan.digest, load.acks)
        if mismatch is not None:
            # Whatever the quorum allows: replicas serving other bytes under one
            # name is the failure this check exists for, not a member to drop.
            return mismatch, left_out | load.worker_errors(), load, []
        serving = self._survivors(load, paused, members, left_out)
        if serving is None:
            return load.summary(), left_out | load.worker_errors(), load, []
        verified = await self._verify(plan, load, serving, phases, listed)
        return verified, left_out, load, serving

    async def _pause_carrying(
        self,
        plan: UpdatePlan,
        targets: list[str],
        members: dict[str, int],
        load_command: LoadCommand,
        phases: dict[str, float],
    ) -> _PauseFailed | tuple[list[str], dict[str, ErrorInfo], PhaseOutcome, bool]:
        """The pause carrying the load, both gathered at once: the members whose
        pause held, those left out, the load outcome among the former and
        whether the frontend listed the name. When the pause fails the update,
        the loads are not waited for: the engines resume at once, and the
        version is withdrawn wherever it may have loaded."""
        # One write, before any engine is told anything: a successor resumes
        # every member and withdraws the version, wherever this one stopped.
        await self._record_phase(Phase.LOAD)
        # The pause and the load each have a phase timeout; the load's clock
        # starts with the pause.
        budget_s = self.config.phase_timeout_s
        load_command = msgspec.structs.replace(load_command, budget_s=2 * budget_s)
        first_loaded = asyncio.Event()
        load_gather = self.bus.acks.expect(
            plan.update_id, Phase.LOAD, targets, first_loaded, self.epoch
        )
        # Opened last, so the status shows the pause while it lasts.
        pause_gather = self.bus.acks.expect(plan.update_id, Phase.PAUSE, targets, None, self.epoch)
        pause_ended: list[float] = []

        def took_the_pause(worker_id: str) -> bool:
            """A load is sent again only to a member whose pause held: one whose
            pause failed, or which has not taken it, must not load (an agent of
            wire version 2 would)."""
            ack = pause_gather.acks.get(worker_id)
            return ack is not None and ack.ok

        loading = asyncio.create_task(
            self._load(
                load_command,
                targets,
                phases,
                first_loaded,
                _Gathering(
                    opened=load_gather,
                    sent=True,
                    resend_if=took_the_pause,
                    # The load phase is the time it adds after the fleet's pause.
                    counted_from=lambda: pause_ended[0] if pause_ended else now(),
                ),
            )
        )
        try:
            # Half the pause's first re-send gap: a pause acked with a load
            # that is still running then gets its own ack before any re-send.
            hold_s = min(_first_resend_gap(budget_s), budget_s) / 2
            spec = msgspec.structs.replace(
                load_command.spec(), budget_s=budget_s, ack_hold_s=hold_s
            )
            pause = await self._pause(plan, targets, phases, then_load=spec, opened=pause_gather)
            pause_ended.append(now())
            left_out: dict[str, ErrorInfo] = {}
            paused = self._survivors(pause, targets, members, left_out)
            if paused is None:
                known = PhaseOutcome(
                    phase=Phase.LOAD,
                    acks=dict(load_gather.acks),
                    missing=sorted(load_gather.waiting),
                    lost=sorted(load_gather.lost),
                    duration_s=0.0,
                    timeout_s=load_command.budget_s,
                )
                return _PauseFailed(pause.summary(), pause.worker_errors(), known)
            kept = set(paused)
            load_gather.drop(w for w in targets if w not in kept)
            # A pause that landed after all (its ack late or lost) runs the load
            # it carried: such members are withdrawn from too if this fails.
            self._may_have_loaded.update(pause.missing + pause.lost)
            load, listed = await loading
        finally:
            loading.cancel()
            self.bus.acks.close(pause_gather)
            self.bus.acks.close(load_gather)
            await asyncio.gather(loading, return_exceptions=True)
        return paused, left_out, load.among(paused), listed

    async def _pause(
        self,
        plan: UpdatePlan,
        targets: list[str],
        phases: dict[str, float],
        then_load: LoadSpec | None = None,
        opened: PhaseGather | None = None,
    ) -> PhaseOutcome:
        """One broadcast to the targets that took a pause of this term, by name
        to the others; each carries the load ``then_load``, if any
        (``opened``: the pause's gather, opened by the caller).

        An agent takes a broadcast pause only once a pause of that term named
        it, so only workers this coordinator counted act on one, and the
        broadcast excludes those it does not count now. At N = 1024 the 1024
        signed publishes of a pause by name were about a seventh of the
        coordinator's CPU per update; now only a term's first update, and a
        member's first update after it (re)started, pay for theirs.
        """
        if self._term_epoch != self.epoch:
            self._term_epoch, self._paused_this_term, self._named_this_term = self.epoch, {}, set()
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
        command = self._cohort_command(
            PauseCommand,
            plan,
            broadcast_to,
            sorted(self._named_this_term | named),
            lease_s=self.config.pause_lease_s,
            then_load=then_load,
        )
        pause = await self._phase(
            command, targets, phases, by_name=by_name, gather=_Gathering(opened=opened)
        )
        for worker_id, ack in pause.acks.items():
            if ack.ok:  # a failed one is named again: it may not have taken it
                took[worker_id] = ack.instance
        return pause

    def _survivors(
        self,
        outcome: PhaseOutcome,
        targets: list[str],
        members: dict[str, int],
        left_out: dict[str, ErrorInfo],
    ) -> list[str] | None:
        """The targets to go on with, or None when the phase failed the update."""
        if outcome.ok:
            return targets
        errors = outcome.worker_errors()
        survivors = [wid for wid in targets if wid not in errors]
        if sum(members[wid] for wid in survivors) < self._needed_world_size():
            return None
        log.warning(
            "going on without %s after %s (quorum %s)",
            sorted(errors),
            outcome.phase,
            self.config.quorum,
        )
        left_out.update(errors)
        return survivors

    def _resumed(
        self, unresumed: dict[str, ErrorInfo], serving: list[str], members: dict[str, int]
    ) -> list[str] | None:
        """The serving members that confirmed their resume, or None when too few
        did. A member left out earlier that cannot be reached (its agent died)
        is named in the result but does not undo the commit of the others; its
        engine resumes when its pause lease runs out or its agent restarts."""
        still = [wid for wid in serving if wid not in unresumed]
        if len(still) == len(serving):
            return serving
        if sum(members[wid] for wid in still) < self._needed_world_size():
            return None
        log.warning("committing without %s: their resume was not confirmed", sorted(unresumed))
        return still

    def _needed_world_size(self) -> int:
        return math.ceil(self.config.quorum * self.config.expected_world_size - 1e-9)

    async def _load(
        self,
        command: LoadCommand,
        expected: list[str],
        phases: dict[str, float],
        first_loaded: asyncio.Event | None = None,
        gathering: _Gathering | None = None,
    ) -> tuple[PhaseOutcome, bool]:
        """The load phase, and whether the frontend listed the new name by its
        end. ``/v1/models`` is a union over workers, so the listing may be
        looked for from the first successful load on, while the other loads
        run, instead of after the last one. A load the pause carried comes
        with the gather opened for it and its first-success event."""
        first_loaded = first_loaded or asyncio.Event()
        looking = asyncio.create_task(self._listed_once(first_loaded, command.served_name))
        try:
            load = await self._phase(
                command, expected, phases, first_ok=first_loaded, gather=gathering
            )
        finally:
            # A look still under way is dropped: verify looks again, in full.
            listed = (
                looking.done()
                and not looking.cancelled()
                and looking.exception() is None
                and looking.result()
            )
            looking.cancel()
            await asyncio.gather(looking, return_exceptions=True)
        return load, listed

    async def _listed_once(self, loaded: asyncio.Event, model: str) -> bool:
        await loaded.wait()
        try:
            await self.frontend.wait_listed(model, self.config.verify_timeout_s)
        except FrontendUnverified:
            return False
        return True

    async def _verify(
        self,
        plan: UpdatePlan,
        load: PhaseOutcome,
        serving: list[str],
        phases: dict[str, float],
        listed: bool,
    ) -> ErrorInfo | None:
        """Every serving member's read-back names the new version, and the
        frontend lists it (``listed``: it already did during the load)."""
        started = now()
        try:
            unlisted = [w for w in serving if plan.served_name not in load.acks[w].adapters]
            if unlisted:
                return ErrorInfo(
                    code=ErrorCode.NOT_LISTED,
                    message=f"{plan.served_name!r} is missing from the read-back of {unlisted}",
                )
            if listed:
                return None
            try:
                await self.frontend.wait_listed(plan.served_name, self.config.verify_timeout_s)
            except FrontendUnverified as exc:
                return ErrorInfo(code=ErrorCode.VERIFY_TIMEOUT, message=str(exc))
            return None
        finally:
            phases[Phase.VERIFY] = now() - started
            self.metrics.phase_seconds.labels(Phase.VERIFY).observe(phases[Phase.VERIFY])

    async def _withdraw_uncommitted(
        self, plan: UpdatePlan, load: PhaseOutcome | None, phases: dict[str, float]
    ) -> None:
        """Unload a version that failed to commit where it did load, so no
        request for it is routed to a subset of the fleet: where a load ack
        lists it, and where a load went unanswered or a pause that carried one
        was (unloading a name an engine lacks succeeds). Each agent runs it
        behind any load of its own, and it is gathered and re-sent like any
        phase."""
        if plan.replace or load is None:
            return
        holders = {w for w, a in load.acks.items() if plan.served_name in a.adapters}
        unsure = set(load.missing) | set(load.lost) | self._may_have_loaded
        await self._unload(plan, [plan.served_name], sorted(holders | unsure), phases)

    async def _unload(
        self, plan: UpdatePlan, names: list[str], targets: list[str], phases: dict[str, float]
    ) -> None:
        """Clean-up after the pause: reported, never fatal to the update."""
        if not names or not targets:
            return
        outcome = await self._phase(
            self._command(UnloadCommand, plan, targets, names=names), targets, phases
        )
        if not outcome.ok:
            log.warning(
                "update=%s unloading %s: %s", plan.update_id, names, outcome.summary().message
            )

    async def _phase(
        self,
        command: PhasedCommand,
        expected: list[str],
        phases: dict[str, float],
        first_ok: asyncio.Event | None = None,
        by_name: list[str] | None = None,
        gather: _Gathering | None = None,
    ) -> PhaseOutcome:
        """Send ``command`` and gather the acks of ``expected`` (its addressees;
        ``by_name``, those of them a cohort command cannot reach)."""
        await self._record_phase(phase_of(command))
        outcome = await self._gather(
            command, expected, first_ok, by_name or [], gather or _Gathering()
        )
        phases[outcome.phase] = outcome.duration_s
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

    def _command(
        self, kind: type[_C], plan: UpdatePlan | InflightRecord, targets: list[str], **fields: Any
    ) -> _C:
        """A command addressed to ``targets`` by name."""
        return kind(
            update_id=plan.update_id,
            targets=targets,
            budget_s=self.config.phase_timeout_s,
            epoch=self.epoch,
            **fields,
        )

    def _cohort_command(
        self,
        kind: type[_C],
        plan: UpdatePlan,
        targets: list[str],
        among: list[str],
        **fields: Any,
    ) -> _C:
        """A command addressed to ``targets`` as a cohort, less the rest of
        ``among``: for a pause, every worker a pause of this term named; for a
        later phase, the pause's targets."""
        kept = set(targets)
        return kind(
            update_id=plan.update_id,
            cohort=True,
            excluded=[wid for wid in among if wid not in kept],
            budget_s=self.config.phase_timeout_s,
            epoch=self.epoch,
            **fields,
        )

    async def _record_phase(self, phase: Phase) -> None:
        """Send the update in flight ahead of the phase's command, for a successor.

        Only the pause and the load change what a successor must undo (resume
        everyone; withdraw the new version too): later phases are not written,
        as each write carries the whole membership. A pause that carries its
        load is written once, as the load, before it goes out; the record never
        steps back to an earlier phase.

        The record goes out on the connection ahead of the command, and the
        command does not wait for the server to store it: a record that is not
        stored must not stop the engines being driven (and resumed), so waiting
        would only add a round trip to every update.
        """
        if self._in_flight is None or phase not in _RECORDED_PHASES:
            return
        order = _RECORDED_PHASES.index
        if self._recorded is not None and order(phase) <= order(self._recorded):
            return
        self._recorded = phase
        self._in_flight = msgspec.structs.replace(self._in_flight, phase=phase)
        self._recording.append(asyncio.create_task(self._write_record(self._in_flight)))
        # One turn of the loop: the write's publish is queued on the connection
        # before the command's (and after an earlier record's, so they land in order).
        await asyncio.sleep(0)

    async def _write_record(self, in_flight: InflightRecord) -> bool:
        try:
            await self.journal.record(in_flight)
        except Exception as exc:  # the engines must still be driven (and resumed)
            log.warning(
                "update=%s could not record phase %s: %s",
                in_flight.update_id,
                in_flight.phase,
                exc,
            )
            return False
        return True

    async def _renew_pause_leases(self, update_id: str) -> None:
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

    async def roll_back(self, in_flight: InflightRecord) -> ErrorInfo:
        """Finish what a dead predecessor left: resume every member, withdraw the
        version it may have loaded, and describe the outcome."""
        targets = sorted(in_flight.members)
        phases: dict[str, float] = {}
        await self._wait_heard(targets)
        # By name: the agents' cohort memory may not have outlived the predecessor.
        resume = await self._phase(
            self._command(ResumeCommand, in_flight, targets), targets, phases
        )
        if in_flight.phase is not Phase.PAUSE and in_flight.served_name != in_flight.adapter:
            await self._phase(
                self._command(UnloadCommand, in_flight, targets, names=[in_flight.served_name]),
                targets,
                phases,
            )
        resumed = "every member resumed" if resume.ok else resume.summary().message
        return ErrorInfo(
            code=ErrorCode.FAILOVER,
            message=f"the coordinator of epoch {in_flight.epoch} stopped mid-update (at or "
            f"after {in_flight.phase}); epoch {self.epoch} rolled the update back ({resumed})",
        )

    async def _wait_heard(self, worker_ids: list[str]) -> None:
        """Until every one of ``worker_ids`` has beaten once, for at most a
        phase's first re-send gap: a leader that has just started may not have
        heard them yet, and a command by name names the agent process it is
        for. One still unheard then counts as gone, as before."""
        deadline = now() + _first_resend_gap(self.config.phase_timeout_s)
        unheard = [w for w in worker_ids if self.membership.instance_of(w) is None]
        while unheard and now() < deadline:
            await asyncio.sleep(_LIVENESS_TICK_S)
            unheard = [w for w in unheard if self.membership.instance_of(w) is None]
        if unheard:
            log.warning("rolling back without word from %s: their agents were not heard", unheard)

    async def _gather(
        self,
        command: PhasedCommand,
        expected: list[str],
        first_ok: asyncio.Event | None,
        by_name: list[str],
        how: _Gathering,
    ) -> PhaseOutcome:
        phase = phase_of(command)
        timeout_s = command.budget_s
        gather = how.opened or self.bus.acks.expect(
            command.update_id, phase, expected, first_ok, command.epoch
        )
        started = now()
        deadline = started + timeout_s
        resend_gap = _first_resend_gap(timeout_s)
        next_resend = started + resend_gap
        sent_at = dict.fromkeys(expected, started)
        looked_at = (-1, 0.0)  # membership generation, and quiet until when
        try:
            if not how.sent and command.cohort and len(by_name) < len(expected):
                await self.bus.broadcast(command)
            named = [] if how.sent else by_name if command.cohort else expected
            if named:
                by_names = msgspec.structs.replace(command, cohort=False, excluded=[])
                await self._send_to_each(by_names, named)
            while not gather.complete:
                raise_if_cancelled()
                at = now()
                if at >= deadline:
                    break
                if await gather.wait(min(deadline, next_resend, at + _LIVENESS_TICK_S) - at):
                    break
                if self.membership.still_quiet(*looked_at):
                    rejoined: list[str] = []  # nothing changed that a look could see
                else:
                    generation = self.membership.generation
                    gone, rejoined, quiet_until = self.membership.triage(gather.waiting, sent_at)
                    looked_at = (generation, quiet_until)
                    gather.give_up_on(gone)
                at = now()
                if at >= deadline or not gather.waiting:
                    continue
                if at >= next_resend:
                    again_to = sorted(gather.waiting)
                    resend_gap *= 2
                    next_resend = at + resend_gap
                else:
                    again_to = sorted(rejoined)
                if how.resend_if is not None:
                    again_to = [w for w in again_to if how.resend_if(w)]
                if again_to:
                    # By name: a restarted agent has forgotten which pauses it took.
                    again = msgspec.structs.replace(
                        command, cohort=False, excluded=[], budget_s=deadline - at
                    )
                    await self._send_to_each(again, again_to)
                    sent_at.update(dict.fromkeys(again_to, at))
        finally:
            self.bus.acks.close(gather)
        return PhaseOutcome(
            phase=phase,
            acks=gather.acks,
            missing=sorted(gather.waiting),
            lost=sorted(gather.lost),
            duration_s=now() - max(started, how.counted_from()),
            timeout_s=timeout_s,
        )

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

    def _result(
        self,
        plan: UpdatePlan,
        status: str,
        phases: dict[str, float],
        members: dict[str, int],
        load: PhaseOutcome | None,
        error: ErrorInfo | None,
        errors: dict[str, ErrorInfo] | None = None,
        rank_map: RankMap | None = None,
    ) -> UpdateResult:
        errors = errors or {}
        acks = load.acks if load is not None else {}
        workers = {
            wid: WorkerOutcome(
                ok=wid not in errors,
                world_size=size,
                error=errors.get(wid),
                adapters=acks[wid].adapters if wid in acks else [],
            )
            for wid, size in sorted(members.items())
        }
        return UpdateResult(
            update_id=plan.update_id,
            status=status,
            adapter=plan.served_name,
            version=plan.version,
            rank_map=rank_map,
            phases={str(k): round(v, 6) for k, v in phases.items()},
            workers=workers,
            error=error,
            path=plan.path,
            digest=(
                agreed_digest(plan.digest, acks, [e.worker_id for e in rank_map.entries])
                if rank_map is not None
                else ""
            ),
        )


def _first_resend_gap(timeout_s: float) -> float:
    return max(_FIRST_RESEND_S, timeout_s * _FIRST_RESEND_SHARE)
