"""Converging on the fleet's committed state, level-triggered.

The fleet's committed state is, for every adapter, its committed version and
the versions kept beside it (:mod:`~lorabus.agents.desired`). The agent
learns it from the fleet's KV (at start, after every reconnect, and once a
minute in case a notice was dropped: every adapter's commit point,
``committed.<adapter>``, listed from the bucket's stream, and the fleet's
latest commit, ``committed``) and from ``committed`` notices. It announces
``ready`` only while its engine holds every served name of that state: at
start, after a reconnect, whenever its engine turns out to have lost one, and
when a notice brings one, it loads what is missing first, one name at a
time, each from its committed path (a ``bus:`` path through the node's
cache) and refusing other bytes than were committed. Reconciling never
unloads. A committed notice also names the older versions to retire: the
agent unloads those its engine holds (never one it must serve), on its own,
once the update has been answered. Both go through the agent's command
queue, behind whatever is queued.

A round of reloads tries each missing name once, committed versions first;
the next round starts at the next check of the engine. A name whose reload
failed ``_STUCK_AFTER_FAILURES`` times in a row will not come on its own: the
heartbeat's ``unready_reason`` then names what is missing and why (while
reloads may still succeed it stays empty, as the coordinator takes a reason
for a member that will not become ready by itself). So does a kept version
whose reload made the engine drop a committed one (an engine that holds fewer
adapters than the fleet keeps): it is not tried again until the committed
state changes, and the committed version is loaded back at once. An engine
that cannot take LoRA updates at all (the executor's ``setup_problem``: a
route or a setting it was started without) is not ready whatever it holds,
says why, and is not asked to reload until it can.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from lorabus.agents.bus import AgentBus
from lorabus.agents.command_queue import CommandQueue
from lorabus.agents.desired import (
    COMMIT_POINTS,
    COMMITTED_KEY,
    COMMITTED_VIEW,
    CommittedView,
    DesiredState,
    Wanted,
    adapter_of_notice,
    target_of_notice,
    target_of_record,
    unready_text,
)
from lorabus.agents.executor import CommandExecutor
from lorabus.agents.fencing import LEADER_RECORD, Fencing
from lorabus.schemas import (
    Ack,
    CommandHandled,
    CommittedNotice,
    LoadCommand,
    PhasedCommand,
    Reconciled,
    UnloadCommand,
    phase_of,
)

# One logger name for all of the agent's lines: the one operators filter on.
log = logging.getLogger("lorabus.agents.agent")

_STATE_READ_TIMEOUT_S = 5
_RECORDS_PER_DEADLINE = 64
"""Commit points read, one after the other, within one read's deadline."""
_RECONCILE_BUDGET_S = 60.0
_RETIRE_BUDGET_S = 10.0
_PUT_OFF_KEPT = 64
"""Retirements put off for pauses, kept until the engine resumes (the
newest: each names what its commit retires)."""
"""Retiring is housekeeping: it must not hold the next pause up for long."""
_STUCK_AFTER_FAILURES = 3
"""Failed reloads of one served name in a row after which the agent says, in
its heartbeat, that its engine will not converge on its own."""


class Convergence:
    """What the fleet has committed, as this agent knows it, and the work that
    brings its engine there."""

    def __init__(
        self,
        bus: AgentBus,
        executor: CommandExecutor,
        fencing: Fencing,
        queue: CommandQueue,
    ) -> None:
        self._bus = bus
        self._executor = executor
        self._worker_id = executor.worker_id
        self._fencing = fencing
        self._queue = queue
        self._desired = DesiredState(executor.worker_id)
        executor.spare = self._desired.stale  # what a load at capacity may unload
        self._committed_known = False
        """A read of the fleet's KV state since this process started showed what
        is committed (or that nothing is). Until then a committed notice may be
        an old one replayed, and is not taken: the next read is."""
        self._stale = False
        """The fleet state in KV must be read again (a reconnect, a failed read)."""
        self._reconciled = asyncio.Event()
        self._reconciled.set()
        self._round: set[str] = set()
        """Served names the current round of reloads has queued."""
        self._failures: dict[str, tuple[int, str]] = {}
        self._put_off: list[UnloadCommand] = []
        """Retiring that waited for a pause, run once the engine is resumed."""
        """Served name -> (failed reloads in a row, why the last one failed)."""
        self._parked: dict[str, str] = {}
        """Kept versions whose reload made the engine drop a committed version
        (it holds too few adapters), and that failure: not tried again while
        the fleet's committed state stays as it is, so that the committed
        versions stay."""
        self._names: frozenset[str] = frozenset()
        """The served names the engine must hold, when :attr:`_parked` was last
        emptied."""

    def missing(self) -> list[Wanted]:
        """What the engine must serve and, by its last read-back, does not."""
        return self._desired.missing(self._executor.adapters)

    @property
    def ready(self) -> bool:
        """Whether the engine can take LoRA updates and holds everything the
        fleet has committed, as far as known."""
        if self._executor.setup_problem:
            return False
        return not self.missing()

    @property
    def reconciling(self) -> bool:
        return not self._reconciled.is_set()

    @property
    def settled(self) -> bool:
        """Ready, with no round of reloads under way: what a heartbeat calls ready."""
        return self.ready and not self.reconciling

    @property
    def stale(self) -> bool:
        return self._stale

    def mark_stale(self) -> None:
        """Notices may have been missed (a reconnect): read the fleet state again."""
        self._stale = True

    async def wait_reconciled(self) -> None:
        """Bounded by the reconciling loads' own budgets."""
        await self._reconciled.wait()

    def unready_reason(self) -> str:
        """Why the engine will not converge on its own: what keeps it from
        taking LoRA updates, or, once reloading a served name has failed
        ``_STUCK_AFTER_FAILURES`` times in a row (or a kept version would push
        a committed one out), what is missing and why ("" while it converges)."""
        if self._executor.setup_problem:
            return self._executor.setup_problem[:4096]
        missing = self.missing()
        failures: dict[str, tuple[int, str]] = {}
        stuck = False
        for name in (w.served_name for w in missing):
            if name in self._parked:
                failures[name] = self._failures.get(name) or (1, self._parked[name])
                stuck = True
            elif name in self._failures:
                failures[name] = self._failures[name]
                stuck = stuck or failures[name][0] >= _STUCK_AFTER_FAILURES
        return unready_text(missing, failures) if stuck else ""

    # -- learning what is committed ------------------------------------------

    def take_notice(self, notice: CommittedNotice) -> None:
        """Act on a committed notice from the bus, if it is news: retire the
        versions it names, and load what it committed. Only forward from what
        the fleet's KV showed: a replayed notice of an older commit changes
        nothing, so before any read has shown what is committed (of its
        adapter) the agent reads again at its next beat instead of taking one."""
        adapter = adapter_of_notice(notice, self._desired.targets)
        readable = self._fencing.readable(f"{COMMITTED_KEY}.{adapter}")
        if not self._committed_known or not readable:
            log.info(
                "worker=%s update=%s committed notice put off: the fleet state is not read yet",
                self._worker_id,
                notice.update_id,
            )
            self._stale = True
            return
        target = target_of_notice(adapter, notice)
        if self._desired.learn(target, kept_known=bool(notice.adapter)):
            self._changed()
            self._retire(notice)
            self.reconcile_if_needed()

    async def read_fleet_state(self) -> None:
        """Learn the committed state and the current epoch from the fleet's KV;
        a read that fails leaves the state stale, to be read at the next check
        (a fleet without state yet is no failure)."""
        self._stale = not await self._read_fleet_state()

    async def _read_fleet_state(self) -> bool:
        began = self._desired.learnings
        try:
            async with asyncio.timeout(_STATE_READ_TIMEOUT_S):
                kv = await self._bus.state_bucket()
                leader = await self._fencing.read_record(kv, "leader", LEADER_RECORD)
                keys = await self._bus.state_keys(COMMIT_POINTS)
                latest = await self._fencing.read_record(kv, COMMITTED_KEY, COMMITTED_VIEW)
            points = await self._read_points(kv, keys)
        except nats.js.errors.BucketNotFoundError:
            self._committed_known = True  # no fleet state yet: nothing is committed
            return True
        except (TimeoutError, nats.errors.Error) as exc:
            log.debug("worker=%s could not read the fleet state: %r", self._worker_id, exc)
            return False
        if leader is not None:
            self._fencing.learn_leader(leader)
        latest_readable = self._fencing.readable(COMMITTED_KEY)
        if latest_readable:
            self._committed_known = True
        seen: set[str] = set()
        for key, point in points.items():
            adapter = key.removeprefix(f"{COMMITTED_KEY}.")
            if point is not None:
                self._desired.learn(target_of_record(adapter, point))
            if point is not None or not self._fencing.readable(key):
                seen.add(adapter)  # an unreadable one: what was known of it stays
        if (
            latest is not None
            and latest.adapter
            and f"{COMMITTED_KEY}.{latest.adapter}" not in points
        ):
            # Written after its commit point, it is never newer than one: the
            # point is the truth (a placement's replacement rewrites only it).
            self._desired.learn(target_of_record(latest.adapter, latest))
            seen.add(latest.adapter)
        if latest_readable:
            for adapter in self._desired.forget_unseen(seen, learnt_before=began):
                log.info(
                    "worker=%s adapter %s is no longer committed (reset): not required",
                    self._worker_id,
                    adapter,
                )
        self._changed()
        return True

    async def _read_points(self, kv: KeyValue, keys: list[str]) -> dict[str, CommittedView | None]:
        """Every adapter's commit point (None: deleted, or it does not decode)."""
        points: dict[str, CommittedView | None] = {}
        for start in range(0, len(keys), _RECORDS_PER_DEADLINE):
            async with asyncio.timeout(_STATE_READ_TIMEOUT_S):
                for key in keys[start : start + _RECORDS_PER_DEADLINE]:
                    point = await self._fencing.read_record(kv, key, COMMITTED_VIEW)
                    points[key] = point
        return points

    def _changed(self) -> None:
        """What the engine must hold changed: a load must not make it drop a
        committed version, and failures of names no longer required are moot."""
        self._executor.committed_names = self._desired.committed_names()
        names = self._desired.names()
        self._failures = {n: f for n, f in self._failures.items() if n in names}
        if names != self._names:
            self._names = names
            self._parked.clear()

    # -- the work that converges ---------------------------------------------

    def reconcile_if_needed(self) -> None:
        """Start a round of reloads if the engine lacks something it must
        serve; unload what it holds of adapters placed elsewhere."""
        self._retire_unplaced()
        if self.reconciling:
            return
        self._round.clear()
        held = set(self._executor.adapters)
        # A name an update loaded meanwhile starts its count again.
        self._failures = {n: f for n, f in self._failures.items() if n not in held}
        if self._queue_next():
            self._reconciled.clear()

    def _queue_next(self) -> bool:
        """Queue the reload of the next missing name this round has not tried
        (committed versions first); False when there is none, or the engine
        cannot take one now (paused by an update, or not set up for updates:
        it would fail the same way, and the heartbeat says why)."""
        if self._executor.paused or self._executor.setup_problem:
            return False
        tried = self._round | self._parked.keys()
        wanted = next((w for w in self.missing() if w.served_name not in tried), None)
        if wanted is None:
            return False
        self._round.add(wanted.served_name)
        log.info(
            "worker=%s loading %s (adapter %s%s), which the fleet serves",
            self._worker_id,
            wanted.served_name,
            wanted.adapter,
            ", kept" if wanted.kept else "",
        )
        load = LoadCommand(
            update_id=f"reconcile-{wanted.version}",
            targets=[self._worker_id],
            budget_s=_RECONCILE_BUDGET_S,
            epoch=self._fencing.epoch_seen,
            served_name=wanted.served_name,
            path=wanted.path,
            # The bytes that were committed, not whatever the path holds now:
            # a directory rewritten since must not be served under the old name.
            digest=wanted.digest or None,
        )
        self._queue.put_internal(load, "reconcile")
        return True

    def still_missing(self, load: LoadCommand) -> bool:
        """Whether a queued reload is still needed when its turn comes: an
        update may have loaded the name meanwhile, a notice retired it."""
        name = load.served_name
        return name in self._desired.names() and name not in self._executor.adapters

    def skipped(self, load: LoadCommand) -> None:
        """A queued reload was not needed any more: go on with the round."""
        log.debug("worker=%s reload of %s not needed any more", self._worker_id, load.served_name)
        if not self._queue_next():
            self._reconciled.set()

    def _retire(self, notice: CommittedNotice) -> None:
        """Unload the versions the fleet no longer keeps, behind whatever is
        queued; never one the engine must serve."""
        unload = UnloadCommand(
            update_id=notice.update_id,
            targets=[self._worker_id],
            budget_s=_RETIRE_BUDGET_S,
            epoch=notice.epoch,
            names=notice.retire,
        )
        self._queue_retiring(unload)

    def _retire_unplaced(self) -> None:
        """Unload what the engine holds of adapters placed on other workers:
        a worker that missed the notice that moved them (away, restarted)
        finds them when it looks at its engine next (every quiet beat)."""
        names = self._desired.unplaced(list(self._executor.adapters))
        if names:
            unload = UnloadCommand(
                update_id="placement",
                targets=[self._worker_id],
                budget_s=_RETIRE_BUDGET_S,
                epoch=self._fencing.epoch_seen,
                names=names,
            )
            self._queue_retiring(unload)

    def put_off(self, unload: PhasedCommand) -> None:
        """Retiring waited for an update's pause: it runs once the engine is
        resumed (:meth:`retire_put_off`), as another adapter's commit may
        not name these versions again for a long time."""
        if isinstance(unload, UnloadCommand):
            self._put_off = [*self._put_off, unload][-_PUT_OFF_KEPT:]

    def retire_put_off(self) -> None:
        """The engine was resumed: queue the retiring put off meanwhile."""
        put_off, self._put_off = self._put_off, []
        for unload in put_off:
            self._queue_retiring(unload)

    def _queue_retiring(self, unload: UnloadCommand) -> None:
        keep = self._desired.names()
        names = [n for n in unload.names if n in self._executor.adapters and n not in keep]
        if names:
            self._queue.put_internal(msgspec.structs.replace(unload, names=names), "retire")

    async def reconciled(self, load: LoadCommand, ack: Ack) -> None:
        """A reload ended (``ack``): count a failure towards
        :meth:`unready_reason`, say how it went, and go on with the round."""
        name = load.served_name
        if ack.ok:
            self._failures.pop(name, None)
        else:
            count = self._failures.get(name, (0, ""))[0] + 1
            self._failures[name] = (count, ack.error.message if ack.error else "unknown error")
        kept = name not in self._desired.committed_names()
        if not ack.ok and kept and self._executor.dropped_committed:
            # The engine holds too few adapters: loading this kept version
            # again would only push a committed one out again. Those go back
            # in now.
            self._parked[name] = self._failures[name][1]
            self._round.difference_update(self._executor.dropped_committed)
        if not self._queue_next():
            self._reconciled.set()
        await self._bus.emit(
            Reconciled(
                ts=time.time(),
                source=self._bus.source,
                worker_id=self._worker_id,
                served_name=name,
                ok=ack.ok,
                error=ack.error,
                epoch=load.epoch,
            )
        )

    async def retired(self, unload: PhasedCommand, ack: Ack) -> None:
        """Retiring ended (``ack``): say how it went."""
        await self._bus.emit(
            CommandHandled(
                ts=time.time(),
                source=self._bus.source,
                update_id=unload.update_id,
                phase=phase_of(unload),
                worker_id=self._worker_id,
                ok=ack.ok,
                error=ack.error,
                epoch=unload.epoch,
            )
        )
