"""Watching a chaos run: the engines of the simulated fleet and the fleet's bus.

The engines are watched in this process, on their own change notifications
(no polling), so a pause is timed where it happens, not where an agent says
it did. On the bus the observer listens as any tap would: events, commands
(for the pause renewals and the epochs they carry; a command addressed to a
pause's cohort is resolved through the pauses seen, and who took a broadcast
pause through its acks; and the ``committed`` notices, for what each commit
keeps beside it), acks (what each agent acted on), heartbeats (for the epoch
each agent reports having seen, and what it said it was ready with) and when
each update was first seen finished. It only listens; it never publishes.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from lorabus.schemas import (
    Ack,
    Command,
    CommandHandled,
    CommandRefused,
    CommittedNotice,
    ErrorCode,
    Heartbeat,
    LeaderElected,
    PauseCommand,
    Phase,
    RenewLeaseCommand,
    Subjects,
    UpdateFinished,
    ack_message_decoder,
    acks_in,
    beat_message_decoder,
    command_decoder,
    event_decoder,
    reports_of,
    tag_of,
)
from lorabus.simfleet import SimFleet, SimWorker
from lorabus.testbed.chaos.timeline import LeaseCommand, Notice, SeenCommand, Timeline, now
from lorabus.testbed.chaos.verdict import UNANSWERED

log = logging.getLogger(__name__)


class EngineWatcher:
    """Records every pause and adapter change of every simulated worker."""

    def __init__(self, sim: SimFleet, timeline: Timeline) -> None:
        self.sim = sim
        self.timeline = timeline

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            for worker in self.sim.workers.values():
                tasks.create_task(self._watch(worker))

    def _record(self, worker: SimWorker) -> tuple[bool, frozenset[str]]:
        state = (worker.paused, frozenset(worker.adapters))
        at = now()
        self.timeline.engine_paused(worker.worker_id, state[0], at)
        self.timeline.engine_adapters(worker.worker_id, state[1], at)
        return state

    async def _watch(self, worker: SimWorker) -> None:
        while True:
            seen = self._record(worker)

            def changed(seen: tuple[bool, frozenset[str]] = seen) -> bool:
                return (worker.paused, frozenset(worker.adapters)) != seen

            if not await worker.wait_until(changed):
                return  # the fleet stopped


class BusObserver:
    """Subscribes to a fleet's events, commands and heartbeats, into a timeline."""

    def __init__(self, subjects: Subjects, timeline: Timeline) -> None:
        self.subjects = subjects
        self.timeline = timeline
        self._subs: list[Subscription] = []
        self._cohorts: dict[tuple[int, str], set[str]] = {}
        """(epoch, update id) -> every worker a pause of it addressed."""
        self._broadcast_pauses: dict[tuple[int, str], float] = {}
        """(epoch, update id) -> when a broadcast pause of it was seen: who took
        it is known only from the acks."""

    async def start(self, nc: NatsClient) -> None:
        s = self.subjects
        self._subs = [
            await nc.subscribe(s.event_any(), cb=self._on_event),
            await nc.subscribe(s.cmd(), cb=self._on_command),
            await nc.subscribe(s.cmd_worker("*"), cb=self._on_command),
            await nc.subscribe(s.heartbeat_any(), cb=self._on_heartbeat),
            await nc.subscribe(s.ack_any(), cb=self._on_ack),
        ]
        await nc.flush(timeout=5)

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # a closed connection has no subscriptions left
                log.debug("unsubscribe: %s", exc)
        self._subs = []

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = event_decoder.decode(msg.data)
        except msgspec.DecodeError:
            self.timeline.undecodable += 1
            return
        at = now()
        self.timeline.event_counts[tag_of(event)] += 1
        match event:
            case CommandHandled():
                self.timeline.handled.append((at, event))
            case CommandRefused():
                self.timeline.refused.append((at, event))
                self.timeline.epoch_seen(event.worker_id, event.epoch_seen, at)
            case LeaderElected(holder=holder, epoch=epoch):
                self.timeline.leaders.append((at, holder, epoch))
            case UpdateFinished(update_id=update_id, error=error):
                if error is None or error.code not in UNANSWERED:
                    self.timeline.finished_seen.setdefault(update_id, at)

    async def _on_command(self, msg: Msg) -> None:
        try:
            command = command_decoder.decode(msg.data)
        except msgspec.DecodeError:
            self.timeline.undecodable += 1
            return
        at = now()
        if isinstance(command, CommittedNotice) and command.adapter:
            self.timeline.notice_seen(
                Notice(
                    at=at,
                    adapter=command.adapter,
                    version=command.version,
                    served_name=command.served_name,
                    kept=frozenset(k.served_name for k in command.kept if k.served_name),
                    update_id=command.update_id,
                )
            )
        targets = self._addressees(command)
        if isinstance(command, PauseCommand) and command.cohort:
            self._broadcast_pauses.setdefault((command.epoch, command.update_id), at)
        self.timeline.command_seen(
            SeenCommand(
                at=at,
                epoch=command.epoch,
                command=tag_of(command),
                update_id=command.update_id,
                targets=targets,
            )
        )
        if isinstance(command, PauseCommand | RenewLeaseCommand):
            for worker_id in targets:
                self.timeline.lease_command(
                    LeaseCommand(
                        worker_id=worker_id,
                        at=at,
                        epoch=command.epoch,
                        update_id=command.update_id,
                    )
                )

    def _addressees(self, command: Command) -> frozenset[str]:
        named = set(command.targets)
        if isinstance(command, PauseCommand):
            key = (command.epoch, command.update_id)
            self._cohorts.setdefault(key, set()).update(named)
        elif command.cohort:
            cohort = self._cohorts.get((command.epoch, command.update_id), set())
            named |= cohort - set(command.excluded)
        return frozenset(named)

    async def _on_ack(self, msg: Msg) -> None:
        try:
            message = ack_message_decoder.decode(msg.data)
        except msgspec.DecodeError:
            self.timeline.undecodable += 1
            return
        for ack in reports_of(message):
            self._took_ack(ack)

    def _took_ack(self, ack: Ack) -> None:
        if ack.error is not None and ack.error.code == ErrorCode.FENCED:
            return  # a refusal, recorded from its command_refused event
        at = now()
        for each in acks_in(ack):  # a load's ack may carry its pause's
            self._took_broadcast_pause(each)
            self.timeline.handled.append((at, _handled(each)))
        # Agents no longer beat after each command: an ack shows the epoch it acted in.
        self.timeline.epoch_seen(ack.worker_id, ack.epoch, at)

    def _took_broadcast_pause(self, ack: Ack) -> None:
        """A pause ack for a broadcast pause: its sender was addressed, when the
        pause was seen (its lease started over then)."""
        key = (ack.epoch, ack.update_id)
        sent_at = self._broadcast_pauses.get(key)
        if ack.phase != Phase.PAUSE or sent_at is None:
            return
        cohort = self._cohorts.setdefault(key, set())
        if ack.worker_id in cohort:
            return
        cohort.add(ack.worker_id)
        worker = frozenset({ack.worker_id})
        self.timeline.command_seen(
            SeenCommand(
                at=sent_at,
                epoch=ack.epoch,
                command="pause",
                update_id=ack.update_id,
                targets=worker,
            )
        )
        self.timeline.lease_command(
            LeaseCommand(
                worker_id=ack.worker_id, at=sent_at, epoch=ack.epoch, update_id=ack.update_id
            )
        )

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            message = beat_message_decoder.decode(msg.data)
        except msgspec.DecodeError:
            self.timeline.undecodable += 1
            return
        for beat in reports_of(message):
            self._took_beat(beat)

    def _took_beat(self, beat: Heartbeat) -> None:
        at = now()
        self.timeline.epoch_seen(beat.worker_id, beat.epoch_seen, at)
        self.timeline.heartbeat(beat.worker_id, beat.paused, at)
        self.timeline.readiness(
            beat.worker_id, beat.instance, beat.ready, frozenset(beat.adapters), at
        )


def _handled(ack: Ack) -> CommandHandled:
    """An ack as the record of a command an agent acted on."""
    return CommandHandled(
        ts=time.time(),
        source=f"agent:{ack.worker_id}",
        update_id=ack.update_id,
        phase=ack.phase,
        worker_id=ack.worker_id,
        ok=ack.ok,
        error=ack.error,
        epoch=ack.epoch,
    )
