"""The agent's side of the bus: commands in, acks, heartbeats and events out.

This is the only module of ``agents`` that talks to NATS. A subscription
callback only decodes and enqueues: engine calls take seconds and would stall
every later message of that subscription. One worker task drains the queue,
so commands for the engine run one at a time, in the order they arrived.

Core NATS is at-most-once, so the coordinator re-sends commands to agents that
have not acked. A re-sent command is recognised by (update id, phase): if it
already ran, its ack is published again; if it is running, it is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from agents.executor import CommandExecutor
from schemas import (
    Ack,
    BadMessage,
    Command,
    CommandHandled,
    Event,
    Heartbeat,
    Subjects,
    command_decoder,
    encode,
    phase_of,
    tag_of,
)

log = logging.getLogger(__name__)

_REMEMBERED_ACKS = 256
_RESUME_ON_EXIT_S = 5.0


class Agent:
    """One agent: serves commands for ``executor.worker_id`` on ``subjects``' fleet."""

    def __init__(
        self, subjects: Subjects, executor: CommandExecutor, *, heartbeat_s: float = 1.0
    ) -> None:
        if heartbeat_s <= 0:
            raise ValueError("heartbeat interval must be > 0")
        self.subjects = subjects
        self.executor = executor
        self.worker_id = executor.worker_id
        self.heartbeat_s = heartbeat_s
        self._queue: asyncio.Queue[tuple[Command, float]] = asyncio.Queue()
        self._running: set[tuple[str, str]] = set()
        self._acks: OrderedDict[tuple[str, str], Ack] = OrderedDict()
        self._nc: NatsClient | None = None

    async def run(self, nc: NatsClient, ready: asyncio.Event | None = None) -> None:
        """Serve until cancelled; set ``ready`` once subscribed and announced."""
        self._nc = nc
        subs = [
            await nc.subscribe(self.subjects.cmd(), cb=self._on_command),
            await nc.subscribe(self.subjects.cmd_worker(self.worker_id), cb=self._on_command),
        ]
        try:
            await nc.flush(timeout=5)
            await self._beat()
            if ready is not None:
                ready.set()
            log.info("worker=%s agent ready on fleet %s", self.worker_id, self.subjects.fleet)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._heartbeat_loop())
                tasks.create_task(self._command_loop())
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await self._resume_if_paused()

    async def _resume_if_paused(self) -> None:
        """A stopping agent resumes its engine: nobody would be left to do it."""
        if not self.executor.paused:
            return
        try:
            async with asyncio.timeout(_RESUME_ON_EXIT_S):
                await self.executor.driver.resume()
            self.executor.paused = False
            log.warning("worker=%s resumed its engine on the way out", self.worker_id)
        except Exception as exc:
            log.error("worker=%s is stopping with its engine paused: %s", self.worker_id, exc)

    async def _on_command(self, msg: Msg) -> None:
        try:
            command = command_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning(
                "worker=%s dropped a malformed command on %s: %s", self.worker_id, msg.subject, exc
            )
            await self._emit(
                BadMessage(
                    ts=time.time(),
                    source=self._source,
                    subject=msg.subject,
                    error=str(exc),
                    size=len(msg.data),
                )
            )
            return
        if self.worker_id not in command.targets:
            return
        key = (command.update_id, tag_of(command))
        if key in self._running:
            return
        done = self._acks.get(key)
        if done is not None:
            await self._publish_ack(done)
            return
        self._running.add(key)
        self._queue.put_nowait((command, time.monotonic()))

    async def _command_loop(self) -> None:
        while True:
            command, received = await self._queue.get()
            budget = command.budget_s - (time.monotonic() - received)
            ack = await self.executor.execute(command, budget)
            key = (command.update_id, tag_of(command))
            self._running.discard(key)
            self._acks[key] = ack
            while len(self._acks) > _REMEMBERED_ACKS:
                self._acks.popitem(last=False)
            await self._publish_ack(ack)
            await self._emit(
                CommandHandled(
                    ts=time.time(),
                    source=self._source,
                    update_id=command.update_id,
                    phase=phase_of(command),
                    worker_id=self.worker_id,
                    ok=ack.ok,
                    error=ack.error,
                )
            )
            await self._beat()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self._beat()

    async def _beat(self) -> None:
        ex = self.executor
        await self._publish(
            self.subjects.heartbeat(self.worker_id),
            encode(
                Heartbeat(
                    worker_id=self.worker_id,
                    world_size=ex.world_size,
                    engine=ex.driver.kind,
                    adapters=list(ex.adapters),
                    paused=ex.paused,
                    interval_s=self.heartbeat_s,
                )
            ),
        )

    async def _publish_ack(self, ack: Ack) -> None:
        await self._publish(self.subjects.ack(self.worker_id), encode(ack))

    async def _emit(self, event: Event) -> None:
        await self._publish(self.subjects.event(tag_of(event)), encode(event))

    async def _publish(self, subject: str, payload: bytes) -> None:
        assert self._nc is not None, "run() sets the connection before anything is published"
        try:
            await self._nc.publish(subject, payload)
        except Exception as exc:  # a closed or draining connection must not kill the loop
            log.warning("worker=%s could not publish on %s: %s", self.worker_id, subject, exc)

    @property
    def _source(self) -> str:
        return f"agent:{self.worker_id}"
