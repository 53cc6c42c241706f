"""The agent's connection: the only code of ``agents`` that talks to NATS.

Everything else in the agent reaches the bus through one :class:`AgentBus`, so
the rules of fencing, converging and beating read as plain async code, and
whatever goes out goes out the same way: acks stamped with this process's
instance, events on the agent's event subjects, and nothing a closed
connection can turn into a dead agent.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol

import msgspec
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

from lorabus.adapters.fetch import ChunkSink, fetch_object
from lorabus.agents.beats import BeatPolicy
from lorabus.bus.connect import wait_flushed
from lorabus.bus.rate_limit import PerSecond
from lorabus.schemas import Ack, Event, Heartbeat, Subjects, encode, tag_of

if TYPE_CHECKING:
    from lorabus.agents.node import NodeLink

# One logger name for all of the agent's lines: the one operators filter on.
log = logging.getLogger("lorabus.agents.agent")

_BAD_EVENTS_PER_S = 10
_FETCH_TIMEOUT_S = 24 * 3600.0
"""A fetch runs under its command's budget; this only ends one nobody bounds."""


class Unsubscribes(Protocol):
    """A subscription, or a worker's place in its node's (agents/node.py)."""

    async def unsubscribe(self) -> None: ...


class AgentBus:
    """One agent's side of one NATS connection (its own, or its node's: then
    its acks and beats go out with its node-mates', through ``node``)."""

    def __init__(
        self,
        nc: NatsClient,
        subjects: Subjects,
        worker_id: str,
        *,
        instance: str,
        beats: BeatPolicy,
        max_adapter_bytes: int,
        node: NodeLink | None = None,
    ) -> None:
        self._nc = nc
        self._node = node
        self._subjects = subjects
        self._worker_id = worker_id
        self._instance = instance
        self._beats = beats
        """Told of every beat and ack that went out: it decides which beats to skip."""
        self._reports = PerSecond(_BAD_EVENTS_PER_S)
        self._max_adapter_bytes = max_adapter_bytes

    @property
    def source(self) -> str:
        """Who the agent's events say they come from."""
        return f"agent:{self._worker_id}"

    @property
    def reconnects(self) -> int:
        """How often the connection came back: notices may have been missed meanwhile."""
        count: int = self._nc.stats["reconnects"]
        return count

    async def subscribe_commands(self, cb: Callable[[Msg], Awaitable[None]]) -> list[Unsubscribes]:
        """Subscribe ``cb`` to the fleet's commands (the node's one subscription,
        in a node) and to this worker's own."""
        own: Subscription = await self._nc.subscribe(
            self._subjects.cmd_worker(self._worker_id), cb=cb
        )
        if self._node is not None:
            return [self._node.commands.join(self._worker_id, cb), own]
        return [await self._nc.subscribe(self._subjects.cmd(), cb=cb), own]

    async def unsubscribe(self, subs: list[Unsubscribes]) -> None:
        for sub in subs:
            with contextlib.suppress(Exception):  # the connection may be gone already
                await sub.unsubscribe()

    async def flush(self) -> None:
        """Wait until the server has what this connection sent (its subscriptions),
        for as long as NATS takes to answer (it may be restarting)."""
        await wait_flushed(self._nc, who=f"worker={self._worker_id}")

    async def state_bucket(self) -> KeyValue:
        """The fleet's state bucket in KV (the leader record, the committed state)."""
        return await self._nc.jetstream().key_value(self._subjects.state_bucket())

    async def state_keys(self, pattern: str) -> list[str]:
        """The state bucket's keys that match ``pattern`` (deleted ones too: a
        delete leaves a marker), from its stream's info: listing keys through
        nats-py creates a consumer, which an agent may not (lorabus.security.roles)."""
        bucket = self._subjects.state_bucket()
        prefix = f"$KV.{bucket}."
        info = await self._nc.jetstream().stream_info(
            f"KV_{bucket}", subjects_filter=prefix + pattern
        )
        return sorted(subject.removeprefix(prefix) for subject in info.state.subjects or {})

    async def fetch_adapter(self, digest: str, into: ChunkSink, *, store: str = "") -> int:
        """Write the adapter ``digest`` of the fleet's object store (``store``:
        that tenant's) into ``into``; its size."""
        return await fetch_object(
            self._nc,
            self._subjects.for_store(store),
            digest,
            into,
            timeout_s=_FETCH_TIMEOUT_S,
            max_bytes=self._max_adapter_bytes,
        )

    def state_subject(self, key: str) -> str:
        """The subject a state record is stored on, to name it in a report."""
        return f"$KV.{self._subjects.state_bucket()}.{key}"

    async def publish_ack(self, ack: Ack) -> None:
        if ack.instance != self._instance:
            ack = msgspec.structs.replace(ack, instance=self._instance)
        if self._node is not None:
            self._node.outbox.put(ack, partial(self._beats.ack_sent, ack))
        elif await self.publish(self._subjects.ack(self._worker_id), encode(ack)):
            self._beats.ack_sent(ack)

    async def send_beat(self, beat: Heartbeat) -> None:
        if self._node is not None:
            self._node.outbox.put(beat, partial(self._beats.beat_sent, beat))
        elif await self.publish(self._subjects.heartbeat(self._worker_id), encode(beat)):
            self._beats.beat_sent(beat)

    async def emit(self, event: Event) -> None:
        await self.publish(
            self._subjects.agent_event(self._worker_id, tag_of(event)), encode(event)
        )

    async def report(self, event: Event) -> None:
        """Emit an event about input this agent would not take (a malformed or
        refused command, an unreadable record), at most ``_BAD_EVENTS_PER_S``
        of them a second in all: a flood of forgeries must not flood the trail."""
        if self._reports.take():
            await self.emit(event)

    async def publish(self, subject: str, payload: bytes) -> bool:
        """Whether ``payload`` went out (to the connection's buffer)."""
        try:
            await self._nc.publish(subject, payload)
        except Exception as exc:  # a closed or draining connection must not kill the loop
            log.warning("worker=%s could not publish on %s: %s", self._worker_id, subject, exc)
            return False
        return True


async def state_entry(kv: KeyValue, key: str) -> bytes | None:
    """The value of ``key`` in the state bucket; None when there is none."""
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None
    return entry.value  # an expired key can come back without one
