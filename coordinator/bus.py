"""The coordinator's core-NATS side: commands and events out, heartbeats and acks in.

Every coordinator of a fleet follows heartbeats and acks (a standby must know
the membership the moment it takes over); only the leader publishes
commands. Heartbeats feed the membership, acks go to the gather waiting for
them through :class:`~lorabus.coordinator.gather.AckRouter` and refresh the
membership's view of each engine. The lifecycle sees only the
:class:`~lorabus.coordinator.lifecycle.CommandBus` protocol, which tests also
implement in memory.
"""

from __future__ import annotations

import logging

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from lorabus.coordinator.gather import AckRouter
from lorabus.coordinator.membership import Membership
from lorabus.schemas import (
    Command,
    Event,
    Subjects,
    ack_decoder,
    encode,
    heartbeat_decoder,
    tag_of,
)

log = logging.getLogger(__name__)


class CoordinatorBus:
    def __init__(self, nc: NatsClient, subjects: Subjects, membership: Membership) -> None:
        self.nc = nc
        self.subjects = subjects
        self.membership = membership
        self.acks = AckRouter()

    async def follow(self) -> list[Subscription]:
        """Subscribe to the fleet's heartbeats and acks; the caller unsubscribes."""
        return [
            await self.nc.subscribe(self.subjects.heartbeat_any(), cb=self._on_heartbeat),
            await self.nc.subscribe(self.subjects.ack_any(), cb=self._on_ack),
        ]

    async def broadcast(self, command: Command) -> None:
        await self.nc.publish(self.subjects.cmd(), encode(command))

    async def send_to(self, worker_id: str, command: Command) -> None:
        await self.nc.publish(self.subjects.cmd_worker(worker_id), encode(command))

    async def emit(self, event: Event) -> None:
        try:
            await self.nc.publish(self.subjects.coordinator_event(tag_of(event)), encode(event))
        except Exception as exc:  # the audit trail must never stop an update
            log.warning("could not emit %s: %s", tag_of(event), exc)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            self.membership.observe(heartbeat_decoder.decode(msg.data))
        except msgspec.DecodeError as exc:
            log.warning("dropped a malformed heartbeat on %s: %s", msg.subject, exc)

    async def _on_ack(self, msg: Msg) -> None:
        try:
            ack = ack_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("dropped a malformed ack on %s: %s", msg.subject, exc)
            return
        self.acks.route(ack)
        self.membership.observe_ack(ack)
