"""The coordinator's core-NATS side: commands and events out, heartbeats and acks in.

Every coordinator of a fleet follows heartbeats and acks (a standby must know
the membership the moment it takes over); only the leader publishes
commands. Heartbeats feed the membership, acks go to the gather waiting for
them through :class:`~lorabus.coordinator.gather.AckRouter` and refresh the
membership's view of each engine. The lifecycle sees only the
:class:`~lorabus.coordinator.ports.CommandBus` protocol, which tests also
implement in memory.

Nothing a heartbeat or an ack claims is taken on trust: the worker id comes
from the subject (server permissions pin each agent to its own subjects) and
must match the body's; a node agent's message, on the subject of its node's
name, carries several workers' acks or beats, each of which must be of one
of that node's workers (:class:`~lorabus.schemas.nodes.NodeRoster`), and
is then taken as that worker's own; the beat period must lie in the coordinator's range;
an ack counts only from the instance that holds its worker id. Anything else
is dropped with a ``bad_message`` event, at most ``_BAD_EVENTS_PER_S`` a
second so that a flood of junk cannot flood the audit trail too.

Nor is a request's reply subject: the coordinator answers with its own rights
(commands, its events, both buckets, the JetStream API), and the server lets
a responder publish once to whatever reply subject a request names. So a
reply goes only to an inbox (:func:`reply_refusal`), or the request is not
served at all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from lorabus.bus.rate_limit import PerSecond
from lorabus.coordinator.gather import AckRouter
from lorabus.coordinator.membership import Conflict, Membership
from lorabus.schemas import (
    Ack,
    BadMessage,
    BadPayload,
    Command,
    Event,
    Heartbeat,
    NodeAcks,
    NodeBeats,
    RefuseInstance,
    Subjects,
    WorkerConflict,
    ack_message_decoder,
    beat_message_decoder,
    encode,
    tag_of,
)
from lorabus.schemas.nodes import NodeRoster
from lorabus.security.signing import CommandSigner

log = logging.getLogger(__name__)

_BAD_EVENTS_PER_S = 10
INBOX_PREFIXES = ("_INBOX.", "_INBOX_", "_R_.")
"""Where a reply may go: the default inboxes, the per-identity ``_INBOX_<key>.``
of ``lorabus auth init``, and the ``_R_.`` subjects the server puts in place of
a reply subject when a request crosses accounts through a service import."""
_SHARED_INBOX_PREFIX = "_INBOX"
_REFUSE_BUDGET_S = 5.0


class CoordinatorBus:
    def __init__(
        self,
        nc: NatsClient,
        subjects: Subjects,
        membership: Membership,
        *,
        heartbeat_range_s: tuple[float, float] = (0.05, 60.0),
        leading: Callable[[], bool] = lambda: False,
        epoch: Callable[[], int] = lambda: 0,
        signer: CommandSigner | None = None,
        nodes: NodeRoster | None = None,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.membership = membership
        self.acks = AckRouter()
        self.heartbeat_range_s = heartbeat_range_s
        self._leading = leading
        self._epoch = epoch
        self._bad_events = PerSecond(_BAD_EVENTS_PER_S)
        self.signer = signer
        self.nodes = nodes or NodeRoster()
        self.dropped = 0
        """Heartbeats and acks dropped as bad, since start."""

    async def follow(self) -> list[Subscription]:
        """Subscribe to the fleet's heartbeats and acks; the caller unsubscribes."""
        return [
            await self.nc.subscribe(self.subjects.heartbeat_any(), cb=self._on_heartbeat),
            await self.nc.subscribe(self.subjects.ack_any(), cb=self._on_ack),
        ]

    async def broadcast(self, command: Command) -> None:
        await self._command(self.subjects.cmd(), command)

    async def send_to(self, worker_id: str, command: Command) -> None:
        await self._command(self.subjects.cmd_worker(worker_id), command)

    async def _command(self, subject: str, command: Command) -> None:
        body = encode(command)
        if self.signer is None:
            await self.nc.publish(subject, body)
        else:
            await self.nc.publish(subject, body, headers=self.signer.headers(subject, body))

    async def emit(self, event: Event) -> None:
        try:
            await self.nc.publish(self.subjects.coordinator_event(tag_of(event)), encode(event))
        except Exception as exc:  # the audit trail must never stop an update
            log.warning("could not emit %s: %s", tag_of(event), exc)

    async def _from_its_senders(self, msg: Msg, message: Any, kind: str) -> list[Any]:
        """The acks or beats of ``message`` that come from whom its subject
        names: a worker's own, or a node's for its own workers."""
        token = _last_token(msg.subject)
        if isinstance(message, NodeAcks | NodeBeats):
            if message.node != token:
                await self._bad(
                    msg, f"a node's {kind}s on the subject of {token!r} claim {message.node!r}"
                )
                return []
            reports = message.acks if isinstance(message, NodeAcks) else message.beats
            taken, refused = [], []
            for report in reports:
                refusal = self.nodes.refusal(token, report.worker_id)
                if refusal is None:
                    taken.append(report)
                else:
                    refused.append(refusal)
            if refused:
                # One report per message, however many entries it forged.
                more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
                await self._bad(msg, f"dropped {kind}s of a node: {refused[0]}{more}")
            return taken
        if message.worker_id != token:
            await self._bad(
                msg, f"{kind} on the subject of {token!r} claims to come from {message.worker_id!r}"
            )
            return []
        if self.nodes.is_node(token):
            await self._bad(msg, f"{kind} of a lone worker on the subject of node {token!r}")
            return []
        return [message]

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            message = beat_message_decoder.decode(msg.data)
        except BadPayload as exc:
            await self._bad(msg, f"not a heartbeat: {exc}")
            return
        for heartbeat in await self._from_its_senders(msg, message, "a heartbeat"):
            await self._take_heartbeat(msg, heartbeat)

    async def _take_heartbeat(self, msg: Msg, heartbeat: Heartbeat) -> None:
        worker_id = heartbeat.worker_id
        low, high = self.heartbeat_range_s
        if not low <= heartbeat.interval_s <= high:
            await self._bad(
                msg,
                f"heartbeat of {worker_id} beats every {heartbeat.interval_s!r}s, outside "
                f"the coordinator's range {low}-{high}s",
            )
            return
        conflict = self.membership.observe(heartbeat)
        if conflict is not None:
            await self._report(conflict)

    async def _on_ack(self, msg: Msg) -> None:
        try:
            message = ack_message_decoder.decode(msg.data)
        except BadPayload as exc:
            await self._bad(msg, f"not an ack: {exc}")
            return
        for ack in await self._from_its_senders(msg, message, "an ack"):
            self._take_ack(ack)

    def _take_ack(self, ack: Ack) -> None:
        worker_id = ack.worker_id
        holder = self.membership.instance_of(worker_id)
        if holder is not None and ack.instance != holder:
            # A second agent with this worker id, not yet refused: its acks
            # must not stand in for the holder's.
            self.dropped += 1
            log.warning(
                "dropped an ack of %s from instance %r: instance %r holds that worker id",
                worker_id,
                ack.instance,
                holder,
            )
            return
        self.acks.route(ack)
        self.membership.observe_ack(ack)

    async def _report(self, conflict: Conflict) -> None:
        holder, refused = conflict.holder, conflict.refused
        if conflict.again:
            log.warning(
                "worker id %s: instance %r still beats after it was refused; refused again",
                conflict.worker_id,
                refused.instance,
            )
        else:
            log.error(
                "worker id %s is claimed by a second agent (instance %r, world size %d) while "
                "instance %r (world size %d) holds it: the newcomer is refused",
                conflict.worker_id,
                refused.instance,
                refused.world_size,
                holder.instance,
                holder.world_size,
            )
            await self.emit(
                WorkerConflict(
                    ts=time.time(),
                    source="coordinator",
                    epoch=self._epoch(),
                    worker_id=conflict.worker_id,
                    holder=holder.instance,
                    refused=refused.instance,
                    world_sizes=[holder.world_size, refused.world_size],
                )
            )
        if self._leading():
            await self.send_to(
                conflict.worker_id,
                RefuseInstance(
                    update_id="conflict",
                    targets=[conflict.worker_id],
                    budget_s=_REFUSE_BUDGET_S,
                    epoch=self._epoch(),
                    instance=refused.instance,
                    holder=holder.instance,
                ),
            )

    async def _bad(self, msg: Msg, error: str) -> None:
        self.dropped += 1
        log.warning("dropped a message on %r: %s", msg.subject, error)
        if not self._bad_events.take():
            return
        await self.emit(
            BadMessage(
                ts=time.time(),
                source="coordinator",
                epoch=self._epoch(),
                subject=msg.subject[:256],
                error=error[:1024],
                size=len(msg.data),
            )
        )


def reply_refusal(reply: str, subjects: Subjects, own_inbox_prefix: str = "") -> str | None:
    """Why the coordinator must not publish an answer on ``reply`` (None: it
    may). Only inboxes pass; never the fleet's own subjects, a ``$`` subject
    (``$KV.``, ``$JS.``, ``$O.``: the store and the JetStream API), nor this
    coordinator's own inbox (where its store reads are answered), unless that
    is the ``_INBOX`` every unnamed client shares. An empty reply asks for no
    answer, and nothing is published."""
    if not reply:
        return None
    prefix = subjects.prefix
    if reply == prefix or reply.startswith(prefix + "."):
        return f"under the fleet's subject prefix {prefix!r}"
    if reply.startswith("$"):
        return "a system subject (store, JetStream API)"
    if not reply.startswith(INBOX_PREFIXES):
        return "not an inbox (_INBOX..., _R_....)"
    if own_inbox_prefix not in ("", _SHARED_INBOX_PREFIX) and reply.startswith(
        own_inbox_prefix + "."
    ):
        return "the coordinator's own inbox"
    if "*" in reply or ">" in reply:
        return "a wildcard"
    return None


def _last_token(subject: str) -> str:
    return subject.rpartition(".")[2]
