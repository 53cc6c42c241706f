"""What the tests of agents converging on every adapter the fleet serves share,
on the in-memory bus (memory_fleet.py): an engine that refuses or holds the
loads of chosen names, notices lost on their way to one agent, and a wait on
what the coordinator's status shows of a member."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from memory_fleet import InMemoryFleet, MemoryEngine

from lorabus.client import UpdateClient
from lorabus.errors import EngineError, NoCoordinator
from lorabus.schemas import CommittedNotice, MemberStatus, command_decoder

DEADLINE_S = 30.0


@dataclass
class PickyEngine(MemoryEngine):
    refuse: set[str] = field(default_factory=set)
    """Loads of these names fail (an engine error, not retried)."""
    hold: dict[str, asyncio.Event] = field(default_factory=dict)
    """Loads of these names wait for their event."""
    loaded: list[str] = field(default_factory=list)
    """The names it loaded, in order."""

    async def load_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        if name in self.hold:
            await self.hold[name].wait()
        if name in self.refuse:
            self.calls.append("load")
            raise EngineError(f"no adapter at {path}", status=400)
        await super().load_adapter(name, path, budget_s=budget_s)
        self.loaded.append(name)


async def member_until(
    client: UpdateClient, worker_id: str, until: Callable[[MemberStatus], bool]
) -> MemberStatus:
    """``worker_id`` as the coordinator's status shows it, once ``until`` holds.
    A coordinator process still starting (nobody answers yet) is waited for,
    like a member not listed yet."""
    async with asyncio.timeout(DEADLINE_S):
        while True:
            try:
                status = await client.status()
            except NoCoordinator:
                status = None
            members = status.members if status is not None else []
            member = next((m for m in members if m.worker_id == worker_id), None)
            if member is not None and until(member):
                return member
            await asyncio.sleep(0.05)


def lose_notices(fleet: InMemoryFleet, worker_id: str, *, but: str = "\0") -> None:
    """Every committed notice whose update id does not start with ``but`` is
    lost on its way to ``worker_id``: what its agent knows of the committed
    state then comes from its reads of the fleet's KV (or from notices a test
    sends itself)."""

    def rule(conn: str, subject: str, data: bytes) -> bool:
        if conn != worker_id or subject != fleet.subjects.cmd():
            return False
        command = command_decoder.decode(data)
        return isinstance(command, CommittedNotice) and not command.update_id.startswith(but)

    fleet.server.drop(rule, times=1_000_000)
