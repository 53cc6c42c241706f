"""The canary phase: the new served name answers a generation, on every member and
through the frontend, before the update commits.

An adapter list that shows a name, and a frontend that lists it, do not
prove that a request for it is served (docs/protocol.md, "The canary").
So once the members serving the new version are known (after the load in
live mode; after the resume in pause mode, since a paused engine holds
generations), each is asked for one token with the served name on its own
engine (:class:`~lorabus.schemas.CanaryCommand`), then the frontend once,
unrouted, as a client would ask. A member whose engine does not answer is
a failed member: the update fails unless the quorum lets it go on without
it, and then the version is unloaded there (it lists a name it cannot
serve, and a router would send it requests). A frontend that does not
answer fails the update. Members whose agents are older than the canary
(wire version 9) are not asked, and the log says so.

``--no-canary`` (``CoordinatorConfig.canary``) turns the phase off for the
fleet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from lorabus.coordinator.phases import Commands
from lorabus.coordinator.ports import Frontend
from lorabus.coordinator.quorum import QuorumPolicy
from lorabus.errors import LorabusError
from lorabus.schemas import CANARY_SINCE, CanaryCommand, ErrorInfo, UnloadCommand

log = logging.getLogger(__name__)


@dataclass
class CanaryOutcome:
    error: ErrorInfo | None
    """Why the update fails (None: it goes on)."""
    serving: list[str]
    """The members that answered (and those too old to be asked)."""
    left_out: dict[str, ErrorInfo] = field(default_factory=dict)
    """Members that did not answer, left out as the quorum allows."""


async def canary(
    commands: Commands,
    frontend: Frontend,
    quorum: QuorumPolicy,
    *,
    update_id: str,
    served_name: str,
    serving: list[str],
    members: dict[str, int],
    among: list[str] | None,
) -> CanaryOutcome:
    """Ask ``serving`` (a cohort of ``among``, the pause's targets; None: by
    name) for a generation as ``served_name``, then the frontend."""
    live = commands.membership.live()
    asked = [w for w in serving if w not in live or live[w].heartbeat.v >= CANARY_SINCE]
    if len(asked) < len(serving):
        old = sorted(set(serving) - set(asked))
        log.info("update=%s canary not asked of %s: agents older than the canary", update_id, old)
    going_on, left_out = list(serving), {}
    if asked:
        if among is None:
            command = commands.named(CanaryCommand, update_id, asked, served_name=served_name)
        else:
            command = commands.cohort(
                CanaryCommand, update_id, asked, among, served_name=served_name
            )
        outcome = await commands.phase(command, asked)
        survivors = quorum.going_on(outcome, serving, members)
        if survivors is None:
            return CanaryOutcome(outcome.summary(), [], outcome.worker_errors())
        going_on, left_out = survivors, outcome.worker_errors()
        if left_out:
            await _unload_from(commands, update_id, served_name, sorted(left_out))
    try:
        await frontend.generate(served_name, commands.config.verify_timeout_s)
    except LorabusError as exc:
        return CanaryOutcome(exc.info(), [], left_out)
    return CanaryOutcome(None, going_on, left_out)


async def _unload_from(
    commands: Commands, update_id: str, served_name: str, workers: list[str]
) -> None:
    """Unload the new version where it did not answer: reported, never fatal."""
    unload = commands.named(UnloadCommand, update_id, workers, names=[served_name])
    outcome = await commands.phase(unload, workers)
    if not outcome.ok:
        log.warning("update=%s unloading %s: %s", update_id, served_name, outcome.summary().message)
