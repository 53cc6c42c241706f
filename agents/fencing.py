"""Which commands an agent obeys: fencing, signatures, and the fleet's records.

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
for the subject it arrived on, and not replayed (see :mod:`lorabus.security.signing`).
The sequence numbers it took live only in this process: a command sent by
name names the agent process it is for (``instance``), so after a restart
none signed before reaches it, and the first it takes is its floor for the
broadcasts of that epoch (docs/protocol.md, "Replays").

Fleet state: a record in KV that does not decode (or, pinned, is not sealed by
the fleet's key) is ignored, the agent keeping the epoch and committed state it
knew, and reported: in every heartbeat (``unreadable_state``) and once as a
``bad_message`` event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from lorabus.agents.bus import AgentBus, state_entry
from lorabus.agents.executor import CommandExecutor
from lorabus.runtime.clock import now
from lorabus.schemas import (
    INSTANCE_BOUND_SINCE,
    Addressing,
    BadMessage,
    Command,
    CommandRefused,
    CommittedNotice,
    ErrorCode,
    ErrorInfo,
    LeaderRecord,
    RefuseInstance,
    RenewLeaseCommand,
    tag_of,
)
from lorabus.security.signing import CommandVerifier

# One logger name for all of the agent's lines: the one operators filter on.
log = logging.getLogger("lorabus.agents.agent")

_REMEMBERED_LEADERS = 64
_LEADER_READ_TIMEOUT_S = 2.0
_LEADER_REREAD_S = 0.5
"""The leader record is read at most once per this, whoever asks: a flood of
forged epochs costs one KV read per interval."""

_T = TypeVar("_T")

LEADER_RECORD = msgspec.json.Decoder(LeaderRecord)


class Fencing:
    """The fleet's leaders as one agent process knows them, and the commands
    it refuses by them."""

    def __init__(
        self,
        bus: AgentBus,
        executor: CommandExecutor,
        verifier: CommandVerifier,
        *,
        instance: str,
    ) -> None:
        self._bus = bus
        self._executor = executor
        """Only for the engine state a ``fenced`` ack carries."""
        self._worker_id = executor.worker_id
        self._verifier = verifier
        self._instance = instance
        self._epoch_seen = 0
        self._leader_keys: dict[int, str] = {}
        """The signing key of each epoch's leader record this agent has read."""
        self._leader_lock = asyncio.Lock()
        self._leader_read = (-1.0, 0)
        """(when, epoch) of the last read of the leader record."""
        self._held: dict[str, Msg] = {}
        """Per subject, the newest command of an epoch the leader record did not
        show yet, checked once more after the next read of the record."""
        self._recheck = asyncio.Event()
        self._unreadable: dict[str, str] = {}
        """Fleet state records (by key) that did not decode at their latest
        read, and why: ignored, and said so in every heartbeat."""

    @property
    def epoch_seen(self) -> int:
        """The highest epoch this agent has seen in the fleet's leader record."""
        return self._epoch_seen

    async def admit(
        self, msg: Msg, command: Command, addressing: Addressing, *, may_hold: bool
    ) -> bool:
        """Whether ``command``, decoded from ``msg``, may be obeyed. If not, it was
        held for another look after the next read of the leader record
        (``may_hold``), dropped as unproven, or refused with a ``fenced`` ack."""
        if self._verifier.required:
            key = await self._signing_key_of(command.epoch)
            if not key and may_hold and command.epoch >= self.epoch_seen:
                self._hold(msg)
                return False
            refusal = self._verifier.check(key, command.epoch, msg.subject, msg.headers, msg.data)
            if refusal is not None:
                await self._refuse_unproven(command, refusal)
                return False
        if addressing is Addressing.NAME and not self._names_this_process(command):
            # Before the epoch check: a captured command of an older term gets
            # no ``fenced`` ack either (its sender is long gone).
            await self._refuse_unproven(
                command,
                f"sent by name to instance {command.instance or '(none)'}, "
                f"not to this agent process ({self._instance})",
            )
            return False
        if command.epoch < self.epoch_seen:
            await self._refuse(command)
            return False
        if command.epoch > self.epoch_seen and not await self._leader_shows(command.epoch):
            if may_hold:
                self._hold(msg)
                return False
            await self._refuse_unproven(
                command,
                f"epoch {command.epoch} is not in the fleet's leader record "
                f"(which shows {self.epoch_seen})",
            )
            return False
        return True

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
            return command.instance == self._instance
        return command.v < INSTANCE_BOUND_SINCE or not self._verifier.required

    def _hold(self, msg: Msg) -> None:
        """Keep ``msg`` to check once more after the next read of the leader
        record (only the newest per subject: a flood cannot grow this)."""
        self._held[msg.subject] = msg
        self._recheck.set()

    async def recheck_loop(self, check: Callable[[Msg], Awaitable[None]]) -> None:
        """Hand each held command to ``check`` once the leader record may be read again."""
        while True:
            await self._recheck.wait()
            self._recheck.clear()
            # The next read of the record is allowed only after the interval.
            await asyncio.sleep(max(0.0, self._leader_read[0] + _LEADER_REREAD_S - now()))
            held, self._held = self._held, {}
            for msg in held.values():
                try:
                    await check(msg)
                except Exception:  # one bad command must not stop the agent
                    log.exception("worker=%s could not check a held command", self._worker_id)

    async def _leader_shows(self, epoch: int) -> bool:
        """Whether the fleet's leader record shows ``epoch`` (or a later one);
        adopt it if so. Reads are shared and spaced out, whoever asks."""
        if epoch > self.epoch_seen:
            await self._reread_leader(lambda: epoch <= self.epoch_seen)
        return epoch <= self.epoch_seen

    async def _signing_key_of(self, epoch: int) -> str:
        """The signing key the leader record of ``epoch`` names ("" if unknown)."""
        if epoch >= self.epoch_seen:
            await self._reread_leader(lambda: epoch in self._leader_keys)
        return self._leader_keys.get(epoch, "")

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
                self.learn_leader(leader)

    def learn_leader(self, leader: LeaderRecord) -> None:
        self._leader_keys[leader.epoch] = leader.signing_key
        while len(self._leader_keys) > _REMEMBERED_LEADERS:
            del self._leader_keys[min(self._leader_keys)]
        self._epoch_seen = max(self._epoch_seen, leader.epoch)

    async def _read_leader(self) -> LeaderRecord | None:
        try:
            async with asyncio.timeout(_LEADER_READ_TIMEOUT_S):
                kv = await self._bus.state_bucket()
                return await self.read_record(kv, "leader", LEADER_RECORD)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("worker=%s could not read the leader record: %r", self._worker_id, exc)
            return None

    # -- the fleet's state records -------------------------------------------

    async def read_record(
        self, kv: KeyValue, key: str, decoder: msgspec.json.Decoder[_T]
    ) -> _T | None:
        """The fleet state record ``key``; None when there is none, or when it
        does not decode: then it is ignored (this agent keeps what it knew),
        and said so, in its heartbeats and once in the trail."""
        value = await state_entry(kv, key)
        if value is None:
            self._unreadable.pop(key, None)
            return None
        try:
            # Pinned to the fleet's keys, only a record the leader sealed counts.
            record = decoder.decode(self._verifier.open_record(key, value))
        except (msgspec.DecodeError, RecursionError, ValueError) as exc:
            await self._report_unreadable(key, str(exc)[:512], len(value))
            return None
        if self._unreadable.pop(key, None) is not None:
            log.warning("worker=%s the fleet state's %s record decodes again", self._worker_id, key)
        return record

    def readable(self, key: str) -> bool:
        """Whether the latest read of record ``key`` did not fail to decode."""
        return key not in self._unreadable

    def unreadable_state(self) -> str:
        """The records ignored for now, and why (a heartbeat's ``unreadable_state``)."""
        return "; ".join(f"{key}: {why}" for key, why in sorted(self._unreadable.items()))[:4096]

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
            self._worker_id,
            key,
            why,
        )
        await self._bus.report(
            BadMessage(
                ts=time.time(),
                source=self._bus.source,
                subject=self._bus.state_subject(key)[:256],
                error=f"the fleet state's {key} record does not decode (or is not the "
                f"leader's); ignored: {why}"[:1024],
                size=size,
                epoch=self.epoch_seen,
            )
        )

    # -- refusing ------------------------------------------------------------

    async def _refuse_unproven(self, command: Command, reason: str) -> None:
        """A command whose sender is not proven: a forged or unsigned one, or one
        ahead of a leader record this agent cannot read yet. Dropped without an
        ack (a real leader re-sends to agents that have not acked)."""
        await self._report_refusal(command, reason)

    async def _refuse(self, command: Command) -> None:
        """A command of an older epoch: refused, and acked ``fenced`` so that a
        deposed coordinator learns why."""
        await self._report_refusal(command, f"it has seen epoch {self.epoch_seen}")
        if isinstance(command, RenewLeaseCommand | CommittedNotice | RefuseInstance):
            return
        await self._bus.publish_ack(
            self._executor.refusal(
                command,
                ErrorInfo(
                    code=ErrorCode.FENCED,
                    message=f"{self._worker_id} refused {tag_of(command)} of epoch "
                    f"{command.epoch}: it has seen epoch {self.epoch_seen}",
                ),
            )
        )

    async def _report_refusal(self, command: Command, reason: str) -> None:
        """Log a refused command and emit ``command_refused`` (rate-limited: a
        flood of forgeries must not flood the trail)."""
        log.warning(
            "worker=%s update=%s refused %s of epoch %d: %s",
            self._worker_id,
            command.update_id,
            tag_of(command),
            command.epoch,
            reason,
        )
        await self._bus.report(
            CommandRefused(
                ts=time.time(),
                source=self._bus.source,
                update_id=command.update_id,
                worker_id=self._worker_id,
                command=tag_of(command),
                epoch=command.epoch,
                epoch_seen=self.epoch_seen,
                reason=reason[:1024],
            )
        )
