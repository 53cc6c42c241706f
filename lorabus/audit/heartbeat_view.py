"""What the agents' heartbeats say about a fleet, for when no coordinator answers.

The coordinator's status is the fleet as it runs it: members, rank offsets,
the committed version, the update in flight. When no coordinator answers,
that is exactly when an operator most needs to see the engines (is one
stuck paused by a coordinator that died mid-update?), and every agent still
says on the bus, once per beat, its world size, engine, paused and ready
flags and adapters. :class:`HeartbeatListener` hears those beats and makes
a view of them: members only, with no committed version, no rank offsets
and no update in flight, because only a coordinator knows those.

Heartbeats are untrusted input, read as the coordinator reads them: each
is decoded with the bounded decoder, a malformed one is counted and
skipped, and the worker id is the subject's, so a heartbeat whose body
names another worker is dropped (counted) rather than shown as that worker.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from lorabus.runtime.clock import now
from lorabus.schemas import (
    BadPayload,
    Heartbeat,
    MemberStatus,
    NodeBeats,
    Subjects,
    beat_message_decoder,
)
from lorabus.schemas.nodes import NodeRoster

log = logging.getLogger(__name__)

LISTEN_S = 2.5
"""How long a one-shot view listens: 2.5 beats of the default 1 s period, so
every live agent at that period is heard at least twice, and an operator
waits about as long as for the status request itself. A fixed window rather
than "until every heard worker beat twice": a worker not heard yet cannot be
waited for, and faster beaters would end the wait before it is heard."""
MAX_LISTEN_S = 10.0
"""The longest a one-shot view listens: an agent that beats more slowly than
the default (its period is in its beat) stretches the window to 1.5 of its
period, so that its peers at that period are heard too, up to this."""
GONE_AFTER_BEATS = 3
"""A member not heard for this many of its periods is left out of the view,
as the coordinator counts it gone (matters for ``--watch``, which keeps
listening)."""


@dataclass(frozen=True)
class HeartbeatView:
    """The fleet as its agents' heartbeats describe it."""

    fleet: str
    subject: str
    """Where the heartbeats were heard (``lorabus.<fleet>.hb.*``)."""
    members: list[MemberStatus]
    """Sorted by worker id; ``rank_offset`` is always None (only a coordinator assigns one)."""
    listened_s: float
    ignored: int
    """Heartbeats skipped: malformed, or naming a worker other than their subject's."""

    @property
    def live_world_size(self) -> int:
        return sum(m.world_size for m in self.members)


class HeartbeatListener:
    """Hears a fleet's heartbeats on one subscription until closed; keeps the last
    beat of each worker. Use as ``async with``, or :func:`listen` for one view."""

    def __init__(self, nc: NatsClient, subjects: Subjects, nodes: NodeRoster | None = None) -> None:
        self.nc = nc
        self.subjects = subjects
        self.nodes = nodes if nodes is not None else NodeRoster.from_env()
        """Which workers each node may beat for (``$LORABUS_NODES_FILE``)."""
        self._last: dict[str, tuple[Heartbeat, float]] = {}
        self._ignored = 0
        self._started = 0.0
        self._sub: Subscription | None = None

    async def __aenter__(self) -> HeartbeatListener:
        self._started = now()
        self._sub = await self.nc.subscribe(self.subjects.heartbeat_any(), cb=self._on_heartbeat)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and not self.nc.is_closed:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the connection is closing anyway
                log.debug("could not unsubscribe from %s: %s", self.subjects.heartbeat_any(), exc)

    @property
    def listened_s(self) -> float:
        return now() - self._started

    def window_s(self, base_s: float = LISTEN_S) -> float:
        """How long a one-shot view should listen, given the periods heard so far."""
        slowest = max((beat.interval_s for beat, _ in self._last.values()), default=0.0)
        return min(max(base_s, 1.5 * slowest), max(base_s, MAX_LISTEN_S))

    async def wait_window(self, base_s: float = LISTEN_S) -> None:
        """Until this listener has listened for :meth:`window_s` (which can grow
        as slower beaters are heard)."""
        while True:
            left = self.window_s(base_s) - self.listened_s
            if left <= 0:
                return
            await asyncio.sleep(left)

    def view(self) -> HeartbeatView:
        at = now()
        members = []
        for worker_id, (beat, heard) in sorted(self._last.items()):
            age = at - heard
            if age > GONE_AFTER_BEATS * beat.interval_s and age > LISTEN_S:
                continue
            members.append(
                MemberStatus(
                    worker_id=worker_id,
                    world_size=beat.world_size,
                    engine=beat.engine,
                    paused=beat.paused,
                    adapters=list(beat.adapters),
                    heartbeat_age_s=round(age, 3),
                    ready=beat.ready,
                    unready_reason=beat.unready_reason,
                )
            )
        return HeartbeatView(
            fleet=self.subjects.fleet,
            subject=self.subjects.heartbeat_any(),
            members=members,
            listened_s=round(self.listened_s, 3),
            ignored=self._ignored,
        )

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            message = beat_message_decoder.decode(msg.data)
        except BadPayload as exc:
            self._ignored += 1
            log.debug("skipped a heartbeat on %r: %s", msg.subject, exc)
            return
        token = msg.subject.rsplit(".", 1)[-1]
        if isinstance(message, NodeBeats):
            # A node's beats, each only for one of its own workers.
            if message.node != token:
                self._ignored += 1
                return
            for beat in message.beats:
                if self.nodes.refusal(token, beat.worker_id) is None:
                    self._last[beat.worker_id] = (beat, now())
                else:
                    self._ignored += 1
            return
        if message.worker_id != token:
            self._ignored += 1
            log.debug("skipped a heartbeat on %r that claims %r", msg.subject, message.worker_id)
            return
        self._last[token] = (message, now())


async def listen(nc: NatsClient, subjects: Subjects, *, base_s: float = LISTEN_S) -> HeartbeatView:
    """One view: listen to ``subjects``' heartbeats for about ``base_s`` seconds
    (longer for slow beaters, see :data:`MAX_LISTEN_S`)."""
    async with HeartbeatListener(nc, subjects) as listener:
        await listener.wait_window(base_s)
        return listener.view()
