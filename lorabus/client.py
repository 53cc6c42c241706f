"""The orchestrator's side: ask a fleet's coordinator for an update, get the result.

    async with await UpdateClient.connect("nats://127.0.0.1:4222", fleet="prod") as bus:
        result = await bus.update("policy", "/ckpt/step_42", version=42)
        if result.committed:
            use(result.rank_map)

A lost answer is harmless: asking again with the same ``update_id`` (and the
same adapter, path and version) returns the first result without touching the
engines. A reply that does not decode (a responder that is not a coordinator
of this wire version, or lies) raises :class:`~lorabus.errors.MalformedReply`.
"""

from __future__ import annotations

import logging
import uuid
from typing import TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from lorabus.bus import close, connect
from lorabus.bus_options import BusOptions
from lorabus.clock import now
from lorabus.errors import MalformedReply, NoCoordinator
from lorabus.schemas import (
    FAILED,
    BadPayload,
    ErrorCode,
    ErrorInfo,
    FleetStatus,
    Reader,
    StatusRequest,
    Subjects,
    UpdateRequest,
    UpdateResult,
    encode,
    fleet_status_decoder,
    update_result_decoder,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")

UPDATE_TIMEOUT_S = 300.0
"""How long ``update()`` waits for a result unless told otherwise."""
STATUS_TIMEOUT_S = 5.0
REASK_S = 5.0
"""Seconds without an answer after which ``update()`` asks again (same update id)."""


class UpdateClient:
    """Asks one fleet's coordinator for updates and its status, over NATS."""

    def __init__(
        self,
        nc: NatsClient,
        fleet: str,
        *,
        owns_connection: bool = False,
        no_coordinator_wait_s: float = 2.0,
        reask_s: float = REASK_S,
    ) -> None:
        if reask_s <= 0:
            raise ValueError(f"reask_s must be > 0, got {reask_s}")
        self.nc = nc
        self.no_coordinator_wait_s = no_coordinator_wait_s
        self.reask_s = reask_s
        self.subjects = Subjects(fleet=fleet)
        self._owns_connection = owns_connection

    @classmethod
    async def connect(
        cls,
        url: str,
        fleet: str,
        *,
        options: BusOptions | None = None,
        connect_timeout_s: float = 10.0,
        reask_s: float = REASK_S,
    ) -> UpdateClient:
        """A client of ``fleet`` on its own connection to ``url``, closed with it,
        as the identity ``options`` give (default: the ``LORABUS_*`` variables,
        as the CLI reads them; see :class:`~lorabus.BusOptions`).

        Raises :class:`~lorabus.errors.BusUnreachable` when NATS cannot be
        reached within ``connect_timeout_s``,
        :class:`~lorabus.errors.PermissionDenied` when it refuses the
        credentials, and :class:`~lorabus.errors.InsecureConnection` before
        exposing them (or the fleet) on an unprotected link.
        """
        nc = await connect(
            url,
            name=f"lorabus-client-{fleet}",
            options=options if options is not None else BusOptions.from_env(),
            connect_timeout_s=connect_timeout_s,
        )
        return cls(nc, fleet, owns_connection=True, reask_s=reask_s)

    async def __aenter__(self) -> UpdateClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_connection:
            await close(self.nc)

    async def update(
        self,
        adapter: str,
        path: str,
        *,
        version: int | None = None,
        update_id: str | None = None,
        timeout_s: float = UPDATE_TIMEOUT_S,
    ) -> UpdateResult:
        """Request an update and wait for its result (committed or failed).

        A request can reach a leader that dies before it answers (killed,
        frozen, cut off); the coordinators cannot tell the requester, so while
        no answer comes the request is sent again every ``reask_s`` seconds
        with the same ``update_id``, which a leader answers with that update's
        one result, its successor too. Failing to hear back is reported as a
        ``failed`` result with code ``no_coordinator`` or ``timeout``; the
        update may still finish, and the same ``update_id`` fetches its result
        later.

        Every request with one ``update_id`` must ask for the same adapter,
        path and version (or no version): other content is answered
        ``bad_request``, naming what the id was first used for. A full queue
        at the coordinator answers ``busy`` at once; send the request again
        later. Raises :class:`~lorabus.errors.MalformedReply` when the reply
        does not decode.
        """
        request = UpdateRequest(
            update_id=update_id or uuid.uuid4().hex, adapter=adapter, path=path, version=version
        )
        subject = self.subjects.update_request()
        deadline = now() + timeout_s
        taken = False
        """Whether a coordinator has had the request: its silence is then a failover."""
        while (remaining := deadline - now()) > 0:
            # Once taken, nobody listening means a successor is on its way.
            patience = remaining if taken else self.no_coordinator_wait_s
            try:
                reply = await self._request(
                    subject, request, min(remaining, self.reask_s), no_responders_s=patience
                )
            except nats.errors.NoRespondersError:
                if taken:
                    break
                return self._unanswered(
                    request,
                    ErrorCode.NO_COORDINATOR,
                    f"no coordinator is listening on fleet {self.subjects.fleet!r} "
                    f"(waited {self.no_coordinator_wait_s:.1f}s for one)",
                )
            except TimeoutError:
                taken = True
                log.info("update=%s no answer yet: asking again", request.update_id)
                continue
            return _decoded(reply, update_result_decoder, f"update result on {subject}")
        return self._unanswered(
            request,
            ErrorCode.TIMEOUT,
            f"no result within {timeout_s:.1f}s; ask again with "
            f"update_id {request.update_id} for the outcome",
        )

    async def status(self, *, timeout_s: float = STATUS_TIMEOUT_S) -> FleetStatus:
        try:
            reply = await self._request(self.subjects.status_request(), StatusRequest(), timeout_s)
        except (nats.errors.NoRespondersError, TimeoutError) as exc:
            raise NoCoordinator(
                f"no coordinator answered on fleet {self.subjects.fleet!r}"
            ) from exc
        return _decoded(
            reply, fleet_status_decoder, f"fleet status on {self.subjects.status_request()}"
        )

    async def _request(
        self,
        subject: str,
        message: msgspec.Struct,
        timeout_s: float,
        *,
        no_responders_s: float | None = None,
    ) -> Msg:
        # "No responders" is answered at once, also while a coordinator is
        # restarting, and a just-connected client can be told so for its first
        # request although the coordinator has subscribed: ask again briefly.
        patience = self.no_coordinator_wait_s if no_responders_s is None else no_responders_s
        retrying = AsyncRetrying(
            stop=stop_after_delay(patience),
            wait=wait_exponential(multiplier=0.05, max=0.5),
            retry=retry_if_exception_type(nats.errors.NoRespondersError),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self.nc.request(subject, encode(message), timeout=timeout_s)
        raise AssertionError("tenacity either returns or re-raises")

    @staticmethod
    def _unanswered(request: UpdateRequest, code: ErrorCode, message: str) -> UpdateResult:
        return UpdateResult(
            update_id=request.update_id,
            status=FAILED,
            adapter=request.adapter,
            version=request.version,
            error=ErrorInfo(code=code, message=message),
        )


def _decoded(reply: Msg, reader: Reader[_T], what: str) -> _T:
    """The reply as ``reader`` decodes it; a malformed one raises MalformedReply."""
    try:
        return reader.decode(reply.data)
    except BadPayload as exc:
        raise MalformedReply(
            f"the reply is not a valid {what} ({len(reply.data)} bytes: {str(exc)[:200]}); "
            "is something other than a lorabus coordinator of this version answering there?"
        ) from None
