"""What only a fleet's operator asks of its coordinator: resetting an
adapter's committed state.

A reset is the way out after a version was committed that no later update can
follow (a version near the int64 bound, a wrong step count): every later
request would be ``stale_version``. The leading coordinator runs it between
updates, answers with a :class:`~lorabus.schemas.ResetResult`, and records a
``committed_reset`` event in the trail. It is asked once, not re-asked: a
reset is not idempotent (a second one finds nothing committed), so an answer
lost on the way is read back from ``lorabus status`` or the trail.
"""

from __future__ import annotations

import nats.errors
from nats.aio.client import Client as NatsClient

from lorabus.errors import MalformedReply, NoCoordinator
from lorabus.schemas import (
    BadPayload,
    ResetRequest,
    ResetResult,
    Subjects,
    encode,
    reset_result_decoder,
)

RESET_TIMEOUT_S = 60.0
"""A reset waits for the update running, if any (30 s per phase by default)."""


async def reset_committed(
    nc: NatsClient,
    subjects: Subjects,
    adapter: str,
    reason: str,
    *,
    expected_version: int | None = None,
    timeout_s: float = RESET_TIMEOUT_S,
) -> ResetResult:
    """Ask the fleet's leader to forget what is committed for ``adapter``;
    with ``expected_version``, only if that version is the committed one."""
    request = ResetRequest(adapter=adapter, reason=reason, expected_version=expected_version)
    try:
        reply = await nc.request(subjects.reset_request(), encode(request), timeout=timeout_s)
    except nats.errors.NoRespondersError as exc:
        raise NoCoordinator(f"no coordinator is listening on fleet {subjects.fleet!r}") from exc
    except TimeoutError as exc:
        raise NoCoordinator(
            f"no coordinator answered the reset on fleet {subjects.fleet!r} within "
            f"{timeout_s:g} s; whether it ran shows in lorabus status and the trail"
        ) from exc
    try:
        return reset_result_decoder.decode(reply.data)
    except BadPayload as exc:
        raise MalformedReply(
            f"the reply is not a valid reset result ({len(reply.data)} bytes: {str(exc)[:200]})"
        ) from None
