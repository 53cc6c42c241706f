"""Converging on the fleet's committed state, level-triggered.

The agent learns the committed adapter from the fleet's KV (at start, after
every reconnect, and once a minute in case a notice was dropped) and from
``committed`` notices. It announces ``ready`` only while its engine holds
what the fleet has committed: at start, after a reconnect, and whenever its
engine turns out to have lost the adapter, it loads the committed adapter
first. A committed notice also names the older versions to retire: the agent
unloads those its engine holds, on its own, once the update has been answered.
Both go through the agent's command queue, behind whatever is queued. An
engine that cannot take LoRA updates at all (the executor's ``setup_problem``:
a route or a setting it was started without) is not ready whatever it holds,
says why, and is not asked to reload until it can.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import nats.errors
import nats.js.errors

from lorabus.agents.bus import AgentBus
from lorabus.agents.command_queue import CommandQueue
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
_RECONCILE_BUDGET_S = 60.0
_RETIRE_BUDGET_S = 10.0
"""Retiring is housekeeping: it must not hold the next pause up for long."""
_STUCK_AFTER_FAILURES = 3
"""Failed reloads of the committed adapter after which the agent says, in its
heartbeat, that its engine will not converge on its own."""


class _CommittedView(msgspec.Struct):
    """The part of the committed record an agent needs (the rank map is skipped
    unbuilt: at 1024 workers it is most of the record's 57 KB)."""

    served_name: str
    path: str
    version: int
    lineage: int = 0
    digest: str = ""


_COMMITTED_VIEW = msgspec.json.Decoder(_CommittedView)


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
        self._committed: CommittedNotice | None = None
        self._committed_known = False
        """A read of the fleet's KV state since this process started showed what
        is committed (or that nothing is). Until then a committed notice may be
        an old one replayed, and is not taken: the next read is."""
        self._stale = False
        """The fleet state in KV must be read again (a reconnect, a failed read)."""
        self._reconciled = asyncio.Event()
        self._reconciled.set()
        self._reconcile_failures = 0
        """Failed reloads of the committed adapter in a row."""
        self._reconcile_error = ("", "")
        """(served name, why) of the last failed reload."""

    @property
    def committed(self) -> CommittedNotice | None:
        """The newest commit this agent knows of (None: nothing is committed)."""
        return self._committed

    @property
    def ready(self) -> bool:
        """Whether the engine can take LoRA updates and holds what the fleet has
        committed, as far as known."""
        if self._executor.setup_problem:
            return False
        return self.committed is None or self.committed.served_name in self._executor.adapters

    @property
    def reconciling(self) -> bool:
        return not self._reconciled.is_set()

    @property
    def settled(self) -> bool:
        """Ready, with no reload of the committed adapter under way: what a
        heartbeat calls ready."""
        return self.ready and not self.reconciling

    @property
    def stale(self) -> bool:
        return self._stale

    def mark_stale(self) -> None:
        """Notices may have been missed (a reconnect): read the fleet state again."""
        self._stale = True

    async def wait_reconciled(self) -> None:
        """Bounded by the reconciling load's own budget."""
        await self._reconciled.wait()

    def unready_reason(self) -> str:
        """Why the engine will not converge: what keeps it from taking LoRA
        updates, or, once reloading the committed adapter has failed
        ``_STUCK_AFTER_FAILURES`` times in a row, why that failed."""
        if self._executor.setup_problem:
            return self._executor.setup_problem[:4096]
        if self.ready or self._reconcile_failures < _STUCK_AFTER_FAILURES:
            return ""
        return (
            f"loading the committed {self._reconcile_error[0]} failed "
            f"{self._reconcile_failures} times: {self._reconcile_error[1]}"
        )[:4096]

    # -- learning what is committed ------------------------------------------

    def _learn_committed(self, notice: CommittedNotice) -> bool:
        """Take ``notice`` unless what this agent knows is committed is newer."""
        # A reset starts a new lineage: its versions may be lower than before.
        if self._committed is None or (notice.lineage, notice.version) >= (
            self._committed.lineage,
            self._committed.version,
        ):
            self._committed = notice
            self._executor.committed_name = notice.served_name
            return True
        return False

    def take_notice(self, notice: CommittedNotice) -> None:
        """Act on a committed notice from the bus, if it is news: retire the
        versions it names, and load what it committed. Only forward from what
        the fleet's KV showed: a replayed notice of an older commit changes
        nothing, so before any read has shown what is committed the agent
        reads again at its next beat instead of taking one."""
        if not self._committed_known:
            log.info(
                "worker=%s update=%s committed notice put off: the fleet state is not read yet",
                self._worker_id,
                notice.update_id,
            )
            self._stale = True
            return
        if self._learn_committed(notice):
            self._retire(notice)
            self.reconcile_if_needed()

    async def read_fleet_state(self) -> None:
        """Learn the committed adapter and the current epoch from the fleet's KV;
        a read that fails leaves the state stale, to be read at the next check
        (a fleet without state yet is no failure)."""
        self._stale = not await self._read_fleet_state()

    async def _read_fleet_state(self) -> bool:
        try:
            async with asyncio.timeout(_STATE_READ_TIMEOUT_S):
                kv = await self._bus.state_bucket()
                committed = await self._fencing.read_record(kv, "committed", _COMMITTED_VIEW)
                leader = await self._fencing.read_record(kv, "leader", LEADER_RECORD)
        except nats.js.errors.BucketNotFoundError:
            self._committed_known = True  # no fleet state yet: nothing is committed
            return True
        except (TimeoutError, nats.errors.Error) as exc:
            log.debug("worker=%s could not read the fleet state: %r", self._worker_id, exc)
            return False
        if self._fencing.readable("committed"):
            self._committed_known = True
        if leader is not None:
            self._fencing.learn_leader(leader)
        if committed is not None:
            self._learn_committed(
                CommittedNotice(
                    update_id="state",
                    targets=[self._worker_id],
                    budget_s=0,
                    epoch=self._fencing.epoch_seen,
                    served_name=committed.served_name,
                    path=committed.path,
                    version=committed.version,
                    lineage=committed.lineage,
                    digest=committed.digest,
                )
            )
        return True

    # -- the work that converges ---------------------------------------------

    def reconcile_if_needed(self) -> None:
        """Queue a load of the committed adapter if the engine lacks it."""
        target = self.committed
        if target is None or self.reconciling or self._executor.paused:
            return
        if self._executor.setup_problem:
            return  # it would fail the same way: the heartbeat says why
        if target.served_name in self._executor.adapters:
            return
        self._reconciled.clear()
        log.info("worker=%s loading the committed %s", self._worker_id, target.served_name)
        load = LoadCommand(
            update_id=f"reconcile-{target.version}",
            targets=[self._worker_id],
            budget_s=_RECONCILE_BUDGET_S,
            epoch=self._fencing.epoch_seen,
            served_name=target.served_name,
            path=target.path,
            # The bytes that were committed, not whatever the path holds now:
            # a directory rewritten since must not be served under the old name.
            digest=target.digest or None,
        )
        self._queue.put_internal(load, "reconcile")

    def _retire(self, notice: CommittedNotice) -> None:
        """Unload the versions the fleet no longer keeps, behind whatever is queued."""
        keep = self.committed.served_name if self.committed is not None else ""
        names = [n for n in notice.retire if n in self._executor.adapters and n != keep]
        if not names:
            return
        unload = UnloadCommand(
            update_id=notice.update_id,
            targets=[self._worker_id],
            budget_s=_RETIRE_BUDGET_S,
            epoch=notice.epoch,
            names=names,
        )
        self._queue.put_internal(unload, "retire")

    async def reconciled(self, load: LoadCommand, ack: Ack) -> None:
        """A reload of the committed adapter ended (``ack``): count a failure
        towards :meth:`unready_reason`, and say how it went."""
        self._reconciled.set()
        if ack.ok:
            self._reconcile_failures = 0
        else:
            self._reconcile_failures += 1
            message = ack.error.message if ack.error else "unknown error"
            self._reconcile_error = (load.served_name, message)
        await self._bus.emit(
            Reconciled(
                ts=time.time(),
                source=self._bus.source,
                worker_id=self._worker_id,
                served_name=load.served_name,
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
