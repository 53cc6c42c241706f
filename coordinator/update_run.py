"""One update's run: quorum -> prepare -> pause (carrying the load) -> verify ->
resume -> canary.

An :class:`UpdateRun` lives for one update and ends as one
:class:`RunOutcome`: the result, and the in-flight record sent for it, if
any (the caller claims its commit on it, and clears it once the result is
stored). Everything it learns on the way (the membership snapshot, the time
of each phase, the members whose pause may have landed unanswered) is its
own, so no state crosses from one update to the next but the term's.

The pause carries the load: each agent loads as soon as its own engine is
paused, so the fleet's pause acks are no barrier before any load (one
message and one round of the bus fewer per update). A fixed-name load
(``replace``) is not carried: it changes what the committed name serves,
so it waits for the whole fleet's pause. A phase that fails on some members
ends the update, unless the quorum policy allows going on without them:
then they are left out. Resume runs in a ``finally``: whatever failed,
every member that may have paused is told to resume. A version that did
not commit is unloaded where it may have loaded. Retiring versions beyond
``keep`` is not a phase: the committed notice names them and each agent
unloads them itself. Live mode loads, verifies and runs the canary with no
pause at all; pause mode runs the canary after the resume, since a paused
engine holds generations (``canary.py``).
An adapter from the fleet's object store (a ``bus:`` path) is fetched by
every member first (prepare), so no pause window holds a transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Iterator

import msgspec

from lorabus.adapters.bus_paths import digest_of
from lorabus.coordinator.canary import PauseWindows, canary
from lorabus.coordinator.capacity import no_room
from lorabus.coordinator.carrying import Carrying, carried_load, may_have_landed
from lorabus.coordinator.digests import digest_problem
from lorabus.coordinator.gather import PhaseGather
from lorabus.coordinator.inflight import InflightJournal
from lorabus.coordinator.outcomes import Carried, Loaded, RunOutcome, Window, run_result
from lorabus.coordinator.phases import Commands, Gathering, PhaseOutcome
from lorabus.coordinator.placed_members import beside, check_versions, wait_placed
from lorabus.coordinator.placement import Served
from lorabus.coordinator.plan import UpdatePlan
from lorabus.coordinator.ports import Frontend, Journal
from lorabus.coordinator.quorum import QuorumPolicy
from lorabus.coordinator.withdraw import withdraw
from lorabus.errors import FrontendUnverified, QuorumNotReached
from lorabus.runtime.clock import now
from lorabus.schemas import (
    COMMITTED,
    FAILED,
    ErrorCode,
    ErrorInfo,
    LoadCommand,
    LoadSpec,
    Phase,
    RankMap,
    ResumeCommand,
    UpdateResult,
    UpdateStarted,
    UpdateStatus,
    build_rank_map,
)


class UpdateRun:
    """One update, from its quorum to its result, on its term's commands."""

    def __init__(
        self,
        plan: UpdatePlan,
        commands: Commands,
        frontend: Frontend,
        journal: Journal,
        *,
        placing: dict[str, Served] | None = None,
        pausing: PauseWindows | None = None,
    ) -> None:
        self.plan = plan
        self._pausing = pausing or PauseWindows()  # the term's (``UpdateRunner``)
        self._placing = {} if placing is None else placing
        """Where the placed updates of the term running now load (``UpdateRunner``)."""
        self.commands = commands
        self.config = commands.config
        self.frontend = frontend
        self.members: dict[str, int] = {}
        """The membership snapshot the update runs on: worker id -> world size."""
        self.durations: dict[str, float] = {}
        """Seconds spent in each phase that ran: a phase on the bus as it
        measured itself (:meth:`_timed`), the quorum and the verify as timed
        here (:meth:`_timing`)."""
        self.quorum = QuorumPolicy(self.config)
        self._in_flight = InflightJournal(journal, plan, commands.epoch)
        self._targets: list[str] = []
        """The members the update's commands address: those that prepared."""
        self._left_out: dict[str, ErrorInfo] = {}
        """Members that failed to prepare, when the quorum let it go on without them."""
        self._may_have_loaded: set[str] = set()
        """Members left out whose pause may still have landed, and with it
        the load it carried."""
        self._layouts: dict[str, tuple[str, int]] = {}
        """Each member's role and data-parallel ranks, as the snapshot saw them."""
        self._canary_failed = False
        """The canary failed: the new version loaded, and does not serve (a
        fixed name included: it is unloaded, and each agent loads the
        committed version again)."""
        self.placed: list[str] = []
        """The workers it places the adapter on ([]: every worker)."""

    async def run(self) -> RunOutcome:
        """Run the plan to a terminal result; never leaves a member told to
        pause unresumed. The writes of the in-flight record have ended by
        then (stored, or failed and logged)."""
        try:
            result = await self._run()
        finally:
            self._placing.pop(self.plan.update_id, None)
            journalled = await self._in_flight.ended()
        return RunOutcome(result, journalled, self.placed)

    async def _run(self) -> UpdateResult:
        check_versions(self.plan, self.commands.membership.live())
        try:
            with self._timing(Phase.QUORUM, metered=False):
                self.members = await self._quorum()
        except QuorumNotReached as exc:
            quorum_error = ErrorInfo(code=ErrorCode.QUORUM_TIMEOUT, message=str(exc))
            return self._failed(quorum_error, {}, None)
        live = self.commands.membership.live()
        beats = {w: live[w].heartbeat for w in self.members if w in live}
        self._layouts = self.commands.membership.layouts(self.members)
        short = no_room(self.plan.own_names, self._beside(), beats)
        if short is not None:
            return self._failed(short, {}, None)
        await self.commands.bus.emit(
            UpdateStarted(
                ts=time.time(),
                source="coordinator",
                update_id=self.plan.update_id,
                adapter=self.plan.served_name,
                version=self.plan.version,
                members=self.members,
                epoch=self.commands.epoch,
            )
        )
        self._targets = sorted(self.members)
        if digest_of(self.plan.path) is not None:
            prepared = await self._prepare()
            if prepared is not None:
                return prepared
        if self.plan.live:
            return await self._run_live()
        return await self._run_paused()

    async def _quorum(self) -> dict[str, int]:
        """The members the update runs on: the fleet's quorum, or the workers
        placed to serve the adapter, whose world sizes are then the whole
        its quorum policy counts (``placed_members.py``)."""
        membership = self.commands.membership
        if self.plan.placement.everywhere:
            return await membership.wait_quorum(
                self.config.expected_world_size,
                self.config.quorum_timeout_s,
                needed=self.quorum.needed_world_size,
                grace_s=self.config.quorum_grace_s,
            )
        members = await wait_placed(self.plan, membership, self.config, self._placing)
        self.placed = sorted(members)
        self.quorum = QuorumPolicy(self.config, world_size=sum(members.values()))
        return members

    def _beside(self) -> list[Served]:
        return beside(self.plan, self._placing)

    async def _prepare(self) -> UpdateResult | None:
        """Every member fetches the adapter into its node's cache, before any
        engine is paused; the failed result, or None to go on (without those
        that failed, where the quorum allows)."""
        prepared = await self._timed(
            self.commands.prepare(self.plan.update_id, self._targets, self.plan.path)
        )
        going_on = self.quorum.going_on(prepared, self._targets, self.members)
        if going_on is None:
            return self._failed(prepared.summary(), prepared.worker_errors(), None)
        self._left_out = {
            wid: error for wid, error in prepared.worker_errors().items() if wid not in going_on
        }
        self._targets = going_on
        return None

    async def _run_paused(self) -> UpdateResult:
        targets = self._targets  # every later command of this update addresses them
        renewing = asyncio.create_task(self.commands.renew_leases(self.plan.update_id))
        paused_at = now()
        self._pausing.opened(self.plan.update_id)
        try:
            window = await self._pause_load_verify(targets)
        finally:
            resume_all = self.commands.cohort(ResumeCommand, self.plan.update_id, targets, targets)
            try:
                resume = await self._timed(self.commands.phase(resume_all, targets))
            finally:
                self._pausing.closed(self.plan.update_id)
                renewing.cancel()
                await asyncio.gather(renewing, return_exceptions=True)
                self.commands.metrics.pause_window_seconds.observe(now() - paused_at)
        unresumed = resume.worker_errors()
        errors = unresumed | window.errors
        error, serving = window.error, window.serving
        if unresumed and error is None:
            resumed = self.quorum.resumed(unresumed, serving, self.members)
            if resumed is None:
                error = resume.summary()
            else:
                serving = resumed
        if error is None:
            # After the resume: a paused engine holds generations.
            error, failed = await self._canary(serving, among=targets)
            errors |= failed
        if error is not None:
            await self._withdraw_uncommitted(window.load)
            return self._failed(error, errors, window.load)
        return self._committed(serving, errors, window.load)

    async def _run_live(self) -> UpdateResult:
        """Load and verify the new versioned name on every member while engines
        keep serving: nothing pauses, so there is nothing to resume; what did
        not commit is unloaded where it loaded, as in pause mode."""
        plan, targets = self.plan, self._targets
        # Named targets, not a pause's cohort: no agent took a pause to join one.
        loaded = await self._load(
            self.commands.named(
                LoadCommand,
                plan.update_id,
                targets,
                served_name=plan.served_name,
                path=plan.path,
                replace=False,
                digest=plan.digest,
            ),
            targets,
        )
        load = loaded.outcome
        error = digest_problem(plan.digest, load.acks)
        serving = self.quorum.going_on(load, targets, self.members) if error is None else None
        if serving is not None:
            error = await self._verify(load, serving, loaded.listed)
        failed: dict[str, ErrorInfo] = {}
        if serving is not None and error is None:
            error, failed = await self._canary(serving, among=None)
            if error is None:
                return self._committed(serving, load.worker_errors(), load)
        await self._withdraw_uncommitted(load)
        # No error of its own: too few members loaded it.
        return self._failed(error or load.summary(), load.worker_errors() | failed, load)

    async def _pause_load_verify(self, targets: list[str]) -> Window:
        """The phases inside the pause."""
        plan = self.plan
        load_command = self.commands.cohort(
            LoadCommand,
            plan.update_id,
            targets,
            targets,
            served_name=plan.served_name,
            path=plan.path,
            replace=plan.replace,
            digest=plan.digest,
            after_pause=True,
        )
        if plan.replace:
            pause = await self._pause(targets)
            paused = self.quorum.going_on(pause, targets, self.members)
            if paused is None:
                return Window(pause.summary(), pause.worker_errors(), None, [])
            left_out = pause.worker_errors()
            kept = set(paused)
            excluded = [w for w in targets if w not in kept]
            loaded = await self._load(
                msgspec.structs.replace(load_command, excluded=excluded), paused
            )
        else:
            carried = await self._pause_carrying(targets, load_command)
            if carried.error is not None:
                return Window(carried.error, carried.errors, carried.loaded.outcome, [])
            paused, left_out, loaded = carried.paused, carried.errors, carried.loaded
        load = loaded.outcome
        mismatch = digest_problem(plan.digest, load.acks)
        if mismatch is not None:
            # Whatever the quorum allows: replicas serving other bytes under one
            # name is the failure this check exists for, not a member to drop.
            return Window(mismatch, left_out | load.worker_errors(), load, [])
        serving = self.quorum.going_on(load, paused, self.members)
        if serving is None:
            return Window(load.summary(), left_out | load.worker_errors(), load, [])
        left_out = left_out | load.worker_errors()
        return Window(await self._verify(load, serving, loaded.listed), left_out, load, serving)

    async def _pause_carrying(self, targets: list[str], load_command: LoadCommand) -> Carried:
        """The pause carrying the load, both gathered at once. When the pause
        fails the update, the loads are not waited for: the engines resume at
        once, and the version is withdrawn wherever it may have loaded."""
        # One write, before any engine is told anything: a successor resumes
        # every member and withdraws the version, wherever this one stopped.
        await self._in_flight.record(Phase.LOAD, self.members)
        # The pause and the load each have a phase timeout; the load's clock
        # starts with the pause.
        budget_s = self.config.phase_timeout_s
        load_command = msgspec.structs.replace(load_command, budget_s=2 * budget_s)
        acks = self.commands.bus.acks
        carrying = Carrying.open(acks, self.plan.update_id, targets, self.commands.epoch)
        loading = asyncio.create_task(
            self._load(load_command, targets, carrying.first_loaded, carrying.load_gathering())
        )
        try:
            pause = await self._pause(
                targets, then_load=carried_load(load_command, budget_s), opened=carrying.pause
            )
            carrying.pause_ended = now()
            paused = self.quorum.going_on(pause, targets, self.members)
            if paused is None:
                so_far = Loaded(carrying.loads_so_far(load_command.budget_s), False)
                return Carried(pause.summary(), [], pause.worker_errors(), so_far)
            kept = set(paused)
            carrying.load.drop(w for w in targets if w not in kept)
            # Withdrawn from too, if the update fails.
            self._may_have_loaded.update(may_have_landed(pause))
            loaded = await loading
        finally:
            loading.cancel()
            acks.close(carrying.pause)
            acks.close(carrying.load)
            await asyncio.gather(loading, return_exceptions=True)
        among = Loaded(loaded.outcome.among(paused), loaded.listed)
        return Carried(None, paused, pause.worker_errors(), among)

    async def _pause(
        self,
        targets: list[str],
        *,
        then_load: LoadSpec | None = None,
        opened: PhaseGather | None = None,
    ) -> PhaseOutcome:
        await self._in_flight.record(Phase.PAUSE, self.members)
        return await self._timed(
            self.commands.pause(
                self.plan.update_id,
                targets,
                then_load=then_load,
                opened=opened,
                shared_with=self.plan.shared_with,
            )
        )

    async def _load(
        self,
        command: LoadCommand,
        expected: list[str],
        first_loaded: asyncio.Event | None = None,
        gathering: Gathering | None = None,
    ) -> Loaded:
        """The load phase, and whether the frontend listed the new name by its
        end. ``/v1/models`` is a union over workers, so the listing may be
        looked for from the first successful load on, while the other loads
        run, instead of after the last one. A load the pause carried comes
        with the gather opened for it and its first-success event."""
        first_loaded = first_loaded or asyncio.Event()
        looking = asyncio.create_task(self._listed_once(first_loaded, command.served_name))
        try:
            await self._in_flight.record(Phase.LOAD, self.members)
            load = await self._timed(
                self.commands.phase(command, expected, first_ok=first_loaded, gather=gathering)
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
        return Loaded(load, listed)

    async def _listed_once(self, loaded: asyncio.Event, model: str) -> bool:
        await loaded.wait()
        try:
            await self.frontend.wait_listed(model, self.config.verify_timeout_s)
        except FrontendUnverified:
            return False
        return True

    async def _verify(
        self, load: PhaseOutcome, serving: list[str], listed: bool
    ) -> ErrorInfo | None:
        """Every serving member's read-back names the new version, and the
        frontend lists it (``listed``: it already did during the load)."""
        served_name = self.plan.served_name
        with self._timing(Phase.VERIFY):
            unlisted = [w for w in serving if served_name not in load.acks[w].adapters]
            if unlisted:
                return ErrorInfo(
                    code=ErrorCode.NOT_LISTED,
                    message=f"{served_name!r} is missing from the read-back of {unlisted}",
                )
            if listed:
                return None
            try:
                await self.frontend.wait_listed(served_name, self.config.verify_timeout_s)
            except FrontendUnverified as exc:
                return ErrorInfo(code=ErrorCode.VERIFY_TIMEOUT, message=str(exc))
            return None

    async def _canary(
        self, serving: list[str], *, among: list[str] | None
    ) -> tuple[ErrorInfo | None, dict[str, ErrorInfo]]:
        """The canary phase (``canary.py``), unless the fleet turned it off:
        why the update fails, and the members that did not answer."""
        if not self.config.canary:
            return None, {}
        with self._timing(Phase.CANARY, metered=False):  # the bus phase meters itself
            outcome = await canary(
                self.commands,
                self.frontend,
                self._pausing,
                update_id=self.plan.update_id,
                served_name=self.plan.served_name,
                serving=serving,
                among=among,
            )
        self._canary_failed = outcome.error is not None
        return outcome.error, outcome.failed

    async def _withdraw_uncommitted(self, load: PhaseOutcome | None) -> None:
        """Unload the version that did not commit (``withdraw.py``)."""
        outcome = await withdraw(
            self.commands,
            self.plan,
            load,
            may_have_loaded=self._may_have_loaded,
            rejected=self._canary_failed,
        )
        if outcome is not None:
            self.durations[outcome.phase] = outcome.duration_s

    async def _timed(self, phase: Awaitable[PhaseOutcome]) -> PhaseOutcome:
        """A phase on the bus, its time recorded as the phase measured it (a
        load the pause carried: from the fleet's pause on)."""
        outcome = await phase
        self.durations[outcome.phase] = outcome.duration_s
        return outcome

    @contextlib.contextmanager
    def _timing(self, phase: Phase, *, metered: bool = True) -> Iterator[None]:
        """Time a phase that runs here rather than on the bus, and observe it
        in the phase metric as the bus phases are, unless not ``metered``."""
        started = now()
        try:
            yield
        finally:
            self.durations[phase] = now() - started
            if metered:
                self.commands.metrics.phase_seconds.labels(phase).observe(self.durations[phase])

    def _failed(
        self, error: ErrorInfo, errors: dict[str, ErrorInfo], load: PhaseOutcome | None
    ) -> UpdateResult:
        return self._result(FAILED, error=error, errors=errors, load=load)

    def _committed(
        self, serving: list[str], errors: dict[str, ErrorInfo], load: PhaseOutcome | None
    ) -> UpdateResult:
        rank_map = build_rank_map({w: self.members[w] for w in serving}, self._layouts)
        return self._result(COMMITTED, errors=errors, load=load, rank_map=rank_map)

    def _result(
        self,
        status: UpdateStatus,
        *,
        errors: dict[str, ErrorInfo],
        load: PhaseOutcome | None,
        error: ErrorInfo | None = None,
        rank_map: RankMap | None = None,
    ) -> UpdateResult:
        return run_result(
            self.plan,
            self.members,
            self.durations,
            status,
            errors=self._left_out | errors,
            acks=load.acks if load is not None else {},
            error=error,
            rank_map=rank_map,
        )
