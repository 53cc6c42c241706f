"""One agent process per node: several workers' agents on one NATS connection.

A node of 8 GPUs runs up to 8 engines, usually with one process per node
watching them (a Slurm task, a Kubernetes DaemonSet). :class:`NodeAgent` runs
one :class:`~lorabus.agents.agent.Agent` per worker of its node, each as it
would run alone (its own engine, queue, fencing, lease and convergence), but
over one connection and one identity, and with what goes over the bus shared:

- :class:`NodeCommands`: one subscription to the fleet's broadcast for the
  whole node, handed to each worker's agent in order, each on a task of its
  own, so one agent waiting (a signature's key being read) holds up no other;
  each worker still hears its own command subject;
- :class:`NodeOutbox`: the workers' acks and heartbeats go out together, one
  ``NodeAcks`` or ``NodeBeats`` message on the node's subject for what they
  answered at about the same time, so the coordinator reads one message per
  node and phase instead of one per worker.

The outbox sends as soon as no worker of the node has a command in hand (an
ack waits only for its node-mates still working on theirs, which the
coordinator waits for anyway), and at the latest :data:`LINGER_S` after the
first report it holds. Heartbeats, which come on each agent's own timer, go
out once every worker's is in, or at that latest.

Failure stays per worker where it can: an engine that fails makes only its
worker's acks fail, and a worker refused its id stops alone. Anything else
that ends a worker's agent ends the process (so that its supervisor starts
it again, as it would a lone agent), and the process dying takes every
worker of the node out at once: their heartbeats stop together, as a
node's power would take them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from lorabus.agents.agent import Agent
from lorabus.errors import DuplicateWorker
from lorabus.schemas import (
    MAX_MESSAGE_BYTES,
    MAX_NODE_WORKERS,
    Ack,
    Heartbeat,
    NodeAcks,
    NodeBeats,
    Subjects,
    encode,
)

log = logging.getLogger("lorabus.agents.agent")

LINGER_S = 0.02
"""The longest a report waits for its node-mates' before it goes out."""
_INBOX_LIMIT = 4096
"""Broadcast commands one worker's agent may have waiting: past this it is
stuck, and what comes is dropped (it is sent again by name if it matters)."""
_FINAL_FLUSH_S = 2.0

Report = Ack | Heartbeat
Sent = Callable[[], None]
"""Told once its report is published (a beat an ack made redundant may then
be skipped: agents/beats.py)."""
_Queued = tuple[Report, Sent | None]


class NodeOutbox:
    """The acks and beats of a node's workers, sent a batch at a time."""

    def __init__(
        self, nc: NatsClient, subjects: Subjects, node: str, *, linger_s: float = LINGER_S
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self._node = node
        self._linger_s = linger_s
        self._pending: list[_Queued] = []
        self._first_at = 0.0
        self._wake = asyncio.Event()
        self._idle: dict[str, Callable[[], bool]] = {}
        """Each running worker's: whether it has no command in hand."""
        self.sent = 0
        """Messages sent, since start."""

    def track(self, worker_id: str, idle: Callable[[], bool]) -> None:
        self._idle[worker_id] = idle

    def untrack(self, worker_id: str) -> None:
        self._idle.pop(worker_id, None)
        self._wake.set()

    def put(self, report: Report, on_sent: Sent | None = None) -> None:
        """Send ``report`` with its node-mates'; ``on_sent`` once it is published."""
        if not self._pending:
            self._first_at = asyncio.get_running_loop().time()
        self._pending.append((report, on_sent))
        self._wake.set()

    def nudge(self) -> None:
        """A worker put down its command: what waited for it may go."""
        if self._pending:
            self._wake.set()

    def _due(self) -> bool:
        if not all(idle() for idle in self._idle.values()):
            return False
        if any(isinstance(report, Ack) for report, _ in self._pending):
            return True
        return {report.worker_id for report, _ in self._pending} >= set(self._idle)

    async def run(self) -> None:
        """Send what is due until cancelled; then what is left, briefly."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._wake.clear()
                if not self._pending:
                    await self._wake.wait()
                    continue
                left_s = self._first_at + self._linger_s - loop.time()
                if left_s > 0 and not self._due():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(left_s):
                            await self._wake.wait()
                    continue
                await self._flush()
        finally:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                async with asyncio.timeout(_FINAL_FLUSH_S):
                    await self._flush()

    async def _flush(self) -> None:
        reports, self._pending = self._pending, []
        # In the order they were put: a beat after an ack must not be read
        # before it (it would undo what the ack said of the engine).
        runs: list[list[_Queued]] = []
        for queued in reports:
            if runs and type(runs[-1][-1][0]) is type(queued[0]):
                runs[-1].append(queued)
            else:
                runs.append([queued])
        for index, run in enumerate(runs):
            try:
                await self._send(run)
            except asyncio.CancelledError:
                # Stopping: what this flush had not sent yet goes first in the
                # last one (sent twice at worst, which acks and beats bear).
                self._pending = [r for rest in runs[index:] for r in rest] + self._pending
                raise

    async def _send(self, reports: list[_Queued]) -> None:
        subject = (
            self._subjects.ack(self._node)
            if isinstance(reports[0][0], Ack)
            else self._subjects.heartbeat(self._node)
        )
        # What the server carries and every reader accepts, with room to spare.
        limit = min(self._nc.max_payload or MAX_MESSAGE_BYTES, MAX_MESSAGE_BYTES) // 2
        for start in range(0, len(reports), MAX_NODE_WORKERS):
            chunk = reports[start : start + MAX_NODE_WORKERS]
            for payload, carried in self._payloads(chunk, limit):
                try:
                    await self._nc.publish(subject, payload)
                except Exception as exc:  # a closed connection must not kill the node
                    # The next batch may go; the coordinator asks again for what this lost.
                    log.warning("node=%s could not publish on %s: %s", self._node, subject, exc)
                    continue
                self.sent += 1
                for _, on_sent in carried:
                    if on_sent is not None:
                        try:
                            on_sent()
                        except Exception:  # bookkeeping must not stop the node's sends
                            log.exception("node=%s: a sent report's callback failed", self._node)

    def _payloads(self, chunk: list[_Queued], limit: int) -> list[tuple[bytes, list[_Queued]]]:
        """The chunk as one message, or halves of it while one is too large;
        each with the reports it carries."""
        reports = [report for report, _ in chunk]
        if isinstance(reports[0], Ack):
            payload = encode(NodeAcks(node=self._node, acks=reports))  # type: ignore[arg-type]
        else:
            payload = encode(NodeBeats(node=self._node, beats=reports))  # type: ignore[arg-type]
        if len(payload) <= limit or len(chunk) == 1:
            return [(payload, chunk)]
        half = len(chunk) // 2
        return self._payloads(chunk[:half], limit) + self._payloads(chunk[half:], limit)


class NodeCommands:
    """One subscription to the fleet's broadcast, handed to each worker's agent."""

    def __init__(self, nc: NatsClient, subjects: Subjects) -> None:
        self._nc = nc
        self._subjects = subjects
        self._inboxes: dict[str, asyncio.Queue[Msg]] = {}
        self._busy: set[str] = set()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(self._subjects.cmd(), cb=self._on_broadcast)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):  # the connection may be gone already
                await self._sub.unsubscribe()
        for worker_id in list(self._tasks):
            await self.leave(worker_id)

    def pending(self, worker_id: str) -> bool:
        """Whether a broadcast waits for, or is in the hands of, this worker's agent."""
        inbox = self._inboxes.get(worker_id)
        return worker_id in self._busy or (inbox is not None and not inbox.empty())

    async def _on_broadcast(self, msg: Msg) -> None:
        for worker_id, inbox in self._inboxes.items():
            try:
                inbox.put_nowait(msg)
            except asyncio.QueueFull:
                log.error("worker=%s is not taking commands: a broadcast was dropped", worker_id)

    def join(self, worker_id: str, cb: Callable[[Msg], Awaitable[None]]) -> _Joined:
        """Hand ``worker_id``'s agent every broadcast from now on, in order."""
        inbox: asyncio.Queue[Msg] = asyncio.Queue(_INBOX_LIMIT)
        self._inboxes[worker_id] = inbox
        self._tasks[worker_id] = asyncio.create_task(
            self._deliver(worker_id, inbox, cb), name=f"node-commands-{worker_id}"
        )
        return _Joined(self, worker_id)

    async def leave(self, worker_id: str) -> None:
        self._inboxes.pop(worker_id, None)
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _deliver(
        self, worker_id: str, inbox: asyncio.Queue[Msg], cb: Callable[[Msg], Awaitable[None]]
    ) -> None:
        while True:
            msg = await inbox.get()
            self._busy.add(worker_id)
            try:
                await cb(msg)
            except Exception:  # as a subscription's callback: one bad message ends nothing
                log.exception("worker=%s failed on a command", worker_id)
            finally:
                self._busy.discard(worker_id)


@dataclass(frozen=True)
class _Joined:
    """A worker's place in the node's broadcast, left as a subscription is."""

    commands: NodeCommands
    worker_id: str

    async def unsubscribe(self) -> None:
        await self.commands.leave(self.worker_id)


@dataclass(frozen=True)
class NodeLink:
    """What a worker's agent shares with the rest of its node."""

    node: str
    outbox: NodeOutbox
    commands: NodeCommands


class NodeAgent:
    """Serves every worker of ``node`` on one connection (module docstring)."""

    def __init__(self, node: str, agents: Sequence[Agent], *, linger_s: float = LINGER_S) -> None:
        if not agents:
            raise ValueError(f"node {node!r} names no worker")
        if len(agents) > MAX_NODE_WORKERS:
            raise ValueError(f"a node drives at most {MAX_NODE_WORKERS} workers, got {len(agents)}")
        self.agents = list(agents)
        ids = [agent.worker_id for agent in self.agents]
        if len(set(ids)) != len(ids):
            raise ValueError(f"node {node!r} names a worker twice")
        if node in ids:
            raise ValueError(f"node {node!r} has the name of one of its workers")
        subjects = {agent.subjects for agent in self.agents}
        if len(subjects) != 1:
            raise ValueError(f"the workers of node {node!r} must be of one fleet")
        self.node = node
        self.subjects = subjects.pop()
        self.linger_s = linger_s

    async def run(self, nc: NatsClient, ready: asyncio.Event | None = None) -> None:
        """Serve every worker until cancelled; set ``ready`` once each is
        announced (or stopped). Raises what stopped the workers if every one
        of them stopped."""
        link = NodeLink(
            self.node,
            NodeOutbox(nc, self.subjects, self.node, linger_s=self.linger_s),
            NodeCommands(nc, self.subjects),
        )
        readies = [asyncio.Event() for _ in self.agents]
        for agent in self.agents:
            agent.node = link
        await link.commands.start()
        outbox = asyncio.create_task(link.outbox.run(), name=f"node-outbox-{self.node}")
        announce = asyncio.create_task(self._announce(readies, ready))
        try:
            async with asyncio.TaskGroup() as workers:
                serving = [
                    workers.create_task(self._serve(agent, nc, r))
                    for agent, r in zip(self.agents, readies, strict=True)
                ]
            stopped = [task.result() for task in serving]
        except* Exception as failed:
            raise failed.exceptions[0] from None
        finally:
            for task in (announce, outbox):
                task.cancel()
            await asyncio.gather(announce, outbox, return_exceptions=True)
            await link.commands.stop()
        errors = [error for error in stopped if error is not None]
        if errors:
            raise errors[0]

    async def _serve(self, agent: Agent, nc: NatsClient, ready: asyncio.Event) -> Exception | None:
        try:
            await agent.run(nc, ready)
        except DuplicateWorker as exc:
            log.error(
                "node=%s worker=%s stopped: %s; the node's other workers go on",
                self.node,
                agent.worker_id,
                exc,
            )
            return exc
        finally:
            ready.set()
        return None

    @staticmethod
    async def _announce(readies: list[asyncio.Event], ready: asyncio.Event | None) -> None:
        await asyncio.gather(*(r.wait() for r in readies))
        if ready is not None:
            ready.set()
