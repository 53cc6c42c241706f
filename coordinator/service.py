"""The coordinator's side of the bus: the only module of ``coordinator`` on NATS.

It feeds heartbeats to the membership and acks to the ack router, answers
update and status requests, and runs queued updates one at a time. Callbacks
never wait for an update: they hand requests to the book and reply from a task
owned by the service's task group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from coordinator.book import UpdateBook, failed_result
from coordinator.config import CoordinatorConfig
from coordinator.frontend import FrontendClient
from coordinator.gather import AckRouter
from coordinator.lifecycle import UpdateRunner
from coordinator.membership import Membership
from coordinator.plan import Committed, is_already_committed, plan_update
from schemas import (
    BadMessage,
    Command,
    ErrorCode,
    ErrorInfo,
    Event,
    FleetStatus,
    LorabusError,
    MemberStatus,
    Subjects,
    UpdateFinished,
    UpdateRequest,
    UpdateResult,
    ack_decoder,
    build_rank_map,
    encode,
    heartbeat_decoder,
    tag_of,
    update_request_decoder,
)

log = logging.getLogger(__name__)


class _NatsCommandBus:
    def __init__(self, nc: NatsClient, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self.acks = AckRouter()

    async def broadcast(self, command: Command) -> None:
        await self.nc.publish(self.subjects.cmd(), encode(command))

    async def send_to(self, worker_id: str, command: Command) -> None:
        await self.nc.publish(self.subjects.cmd_worker(worker_id), encode(command))

    async def emit(self, event: Event) -> None:
        try:
            await self.nc.publish(self.subjects.event(tag_of(event)), encode(event))
        except Exception as exc:  # the audit trail must never stop an update
            log.warning("could not emit %s: %s", tag_of(event), exc)


class Coordinator:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self.subjects = Subjects(fleet=config.fleet, prefix=config.subject_prefix)
        self.membership = Membership()
        self.book = UpdateBook()

    async def run(self, nc: NatsClient, ready: asyncio.Event | None = None) -> None:
        """Serve the fleet until cancelled; set ``ready`` once subscribed."""
        bus = _NatsCommandBus(nc, self.subjects)
        frontend = FrontendClient(
            self.config.frontend_url,
            headers=self.config.headers,
            timeout_s=self.config.http_timeout_s,
        )
        runner = UpdateRunner(self.config, self.membership, frontend, bus)
        replies: set[asyncio.Task[None]] = set()
        subs = []
        try:
            subs = [
                await nc.subscribe(self.subjects.heartbeat_any(), cb=self._on_heartbeat),
                await nc.subscribe(self.subjects.ack_any(), cb=self._make_ack_cb(bus)),
                await nc.subscribe(
                    self.subjects.update_request(), cb=self._make_request_cb(replies, bus)
                ),
                await nc.subscribe(self.subjects.status_request(), cb=self._on_status),
            ]
            await nc.flush(timeout=5)
            log.info("coordinator ready on fleet %s", self.config.fleet)
            if ready is not None:
                ready.set()
            await self._run_updates(runner, bus)
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            # Nobody is left waiting for an answer that will never come.
            self.book.fail_all_pending(
                ErrorInfo(
                    code=ErrorCode.INTERNAL,
                    message="the coordinator stopped before this update finished",
                )
            )
            await _settle(replies, timeout_s=2.0)
            await frontend.aclose()

    async def _run_updates(self, runner: UpdateRunner, bus: _NatsCommandBus) -> None:
        while True:
            request = await self.book.next_request()
            result = await self._execute(request, runner)
            self.book.finish(request, result)
            await bus.emit(
                UpdateFinished(
                    ts=time.time(),
                    source="coordinator",
                    update_id=request.update_id,
                    status=result.status,
                    error=result.error,
                )
            )
            log.info(
                "update=%s %s %s",
                request.update_id,
                result.status,
                result.error.message if result.error else result.adapter,
            )

    async def _execute(self, request: UpdateRequest, runner: UpdateRunner) -> UpdateResult:
        try:
            committed = self.book.committed.get(request.adapter)
            plan = plan_update(request, self.config, committed)
            if committed is not None and is_already_committed(plan, committed):
                return UpdateResult(
                    update_id=request.update_id,
                    status="committed",
                    adapter=committed.served_name,
                    version=committed.version,
                    rank_map=committed.rank_map,
                )
            result = await runner.run(plan)
            if result.committed and result.rank_map is not None:
                self.book.commit(
                    Committed(
                        adapter=plan.adapter,
                        version=plan.version,
                        path=plan.path,
                        served_name=plan.served_name,
                        rank_map=result.rank_map,
                    )
                )
            return result
        except LorabusError as exc:
            return failed_result(request, exc.info())
        except Exception as exc:
            log.exception("update=%s crashed", request.update_id)
            return failed_result(
                request,
                ErrorInfo(
                    code=ErrorCode.INTERNAL,
                    message=f"{type(exc).__name__}: {exc}",
                ),
            )

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            self.membership.observe(heartbeat_decoder.decode(msg.data))
        except msgspec.DecodeError as exc:
            log.warning("dropped a malformed heartbeat on %s: %s", msg.subject, exc)

    def _make_ack_cb(self, bus: _NatsCommandBus):
        async def on_ack(msg: Msg) -> None:
            try:
                bus.acks.route(ack_decoder.decode(msg.data))
            except msgspec.DecodeError as exc:
                log.warning("dropped a malformed ack on %s: %s", msg.subject, exc)

        return on_ack

    def _make_request_cb(self, replies: set[asyncio.Task[None]], bus: _NatsCommandBus):
        async def on_request(msg: Msg) -> None:
            try:
                request = update_request_decoder.decode(msg.data)
            except msgspec.DecodeError as exc:
                await bus.emit(
                    BadMessage(
                        ts=time.time(),
                        source="coordinator",
                        subject=msg.subject,
                        error=str(exc),
                        size=len(msg.data),
                    )
                )
                bad = UpdateRequest(update_id="", adapter="", path="")
                await _reply(
                    msg,
                    failed_result(
                        bad,
                        ErrorInfo(
                            code=ErrorCode.BAD_REQUEST,
                            message=f"malformed update request: {exc}",
                        ),
                    ),
                )
                return
            future = self.book.submit(request)
            reply = asyncio.create_task(_reply_when_done(msg, future))
            replies.add(reply)
            reply.add_done_callback(replies.discard)

        return on_request

    async def _on_status(self, msg: Msg) -> None:
        await _reply(msg, self.status())

    def status(self) -> FleetStatus:
        live = self.membership.live()
        latest = self.book.latest
        rank_map = (
            latest.rank_map
            if latest
            else build_rank_map({wid: m.heartbeat.world_size for wid, m in live.items()})
        )
        members = [
            MemberStatus(
                worker_id=wid,
                world_size=m.heartbeat.world_size,
                engine=m.heartbeat.engine,
                paused=m.heartbeat.paused,
                adapters=m.heartbeat.adapters,
                heartbeat_age_s=round(self.membership.age_of(m), 3),
                rank_offset=rank_map.offset_of(wid),
            )
            for wid, m in sorted(live.items())
        ]
        return FleetStatus(
            fleet=self.config.fleet,
            expected_world_size=self.config.expected_world_size,
            live_world_size=sum(m.world_size for m in members),
            members=members,
            committed_adapter=latest.served_name if latest else None,
            committed_version=latest.version if latest else None,
            rank_map=latest.rank_map if latest else None,
            in_flight=self.book.running,
        )


async def _reply_when_done(msg: Msg, future: asyncio.Future[UpdateResult]) -> None:
    await _reply(msg, await asyncio.shield(future))


async def _reply(msg: Msg, message: msgspec.Struct) -> None:
    if not msg.reply:
        return
    try:
        await msg.respond(encode(message))
    except Exception as exc:
        log.warning("could not reply on %s: %s", msg.reply, exc)


async def _settle(tasks: set[asyncio.Task[None]], timeout_s: float) -> None:
    """Let pending replies go out, then cancel and await whatever is left."""
    if not tasks:
        return
    _, late = await asyncio.wait(set(tasks), timeout=timeout_s)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
