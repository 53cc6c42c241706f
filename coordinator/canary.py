"""The canary phase: the new served name answers a generation, on every member and
through the frontend, before the update commits.

An adapter list that shows a name, and a frontend that lists it, do not
prove that a request for it is served (docs/protocol.md, "The canary").
So once the members serving the new version are known (after the load in
live mode; after the resume in pause mode, since a paused engine holds
generations), each is asked for one token with the served name on its own
engine (:class:`~lorabus.schemas.CanaryCommand`), then the frontend once,
unrouted, as a client would ask. A member whose engine does not answer
fails the update, whatever the quorum allows (as other bytes under one name
do): left out, it would still list the name, and its agent would load the
committed version again at its next look. So would a frontend that does
not answer. Members whose agents are older than the canary (wire version
9) are not asked, and the log says so.

``--no-canary`` (``CoordinatorConfig.canary``) turns the phase off for the
fleet.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from lorabus.coordinator.phases import Commands
from lorabus.coordinator.ports import Frontend
from lorabus.errors import LorabusError
from lorabus.schemas import CANARY_SINCE, CanaryCommand, ErrorInfo

log = logging.getLogger(__name__)


class PauseWindows:
    """The pause windows of the term's updates running now, from the pause
    sent to the resume done. A canary waits until no other update's window
    is open: a paused engine holds generations, and an update of another
    adapter (a round-mate's slow verify, a live update beside a pause) must
    not fail for the time another's pause lasts. Each window ends, whatever
    happens, with its update's resume phase (bounded by its deadlines)."""

    def __init__(self) -> None:
        self._open: set[str] = set()
        self._changed = asyncio.Event()

    def opened(self, update_id: str) -> None:
        self._open.add(update_id)

    def closed(self, update_id: str) -> None:
        """Synchronous, so that a ``finally`` of a cancelled update still runs it."""
        self._open.discard(update_id)
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_closed(self, but: str) -> None:
        """Until every window but ``but``'s is closed."""
        while self._open - {but}:
            await self._changed.wait()


@dataclass
class CanaryOutcome:
    error: ErrorInfo | None
    """Why the update fails (None: it commits)."""
    failed: dict[str, ErrorInfo] = field(default_factory=dict)
    """The members that did not answer, and what their engines said."""


async def canary(
    commands: Commands,
    frontend: Frontend,
    pausing: PauseWindows,
    *,
    update_id: str,
    served_name: str,
    serving: list[str],
    among: list[str] | None,
) -> CanaryOutcome:
    """Ask ``serving`` (a cohort of ``among``, the pause's targets; None: by
    name) for a generation as ``served_name``, then the frontend; once no
    other update's pause window is open (``pausing``): its round's last
    resume resumes the engines."""
    await pausing.wait_closed(but=update_id)
    live = commands.membership.live()
    asked = [w for w in serving if w not in live or live[w].heartbeat.v >= CANARY_SINCE]
    if len(asked) < len(serving):
        old = sorted(set(serving) - set(asked))
        log.warning(
            "update=%s canary not asked of %s: agents older than the canary (wire < %d)",
            update_id,
            old,
            CANARY_SINCE,
        )
    if asked:
        if among is None:
            command = commands.named(CanaryCommand, update_id, asked, served_name=served_name)
        else:
            command = commands.cohort(
                CanaryCommand, update_id, asked, among, served_name=served_name
            )
        outcome = await commands.phase(command, asked)
        if not outcome.ok:
            return CanaryOutcome(outcome.summary(), outcome.worker_errors())
    try:
        await frontend.generate(served_name, commands.config.verify_timeout_s)
    except LorabusError as exc:
        return CanaryOutcome(exc.info())
    return CanaryOutcome(None)
