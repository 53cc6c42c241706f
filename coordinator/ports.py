"""What an update sees of the world: the bus, the frontend, the journal.

The lifecycle (``lifecycle.py``, ``phases.py``, ``update_run.py``) reaches
NATS, the frontend's HTTP and the fleet's KV only through these small
protocols, so it reads as plain async code.
The real ones are :class:`~lorabus.coordinator.bus.CoordinatorBus`,
:class:`~lorabus.coordinator.frontend.FrontendClient` and
:class:`~lorabus.coordinator.store.FleetStore`.
"""

from __future__ import annotations

from typing import Protocol

from lorabus.coordinator.gather import AckRouter
from lorabus.schemas import Command, Event, InflightRecord, PhasedCommand


class CommandBus(Protocol):
    """How commands go out and acks come back (core NATS; in memory in tests)."""

    acks: AckRouter

    async def broadcast(self, command: Command) -> None: ...

    async def send_to(self, worker_id: str, command: PhasedCommand) -> None: ...

    async def emit(self, event: Event) -> None: ...


class Frontend(Protocol):
    """What the verify and canary phases ask of the frontend (an HTTP client; a fake in tests)."""

    async def wait_listed(self, model: str, timeout_s: float) -> float:
        """Seconds until ``model`` was listed; raises FrontendUnverified at the deadline."""
        ...

    async def generate(self, model: str, timeout_s: float) -> str:
        """One greedy token from ``model`` through the frontend; raises
        CanaryFailed unless it answered as ``model``."""
        ...


class Journal(Protocol):
    """Where the update in flight is sent ahead of its pause (and its load), so
    that a successor finds it (the fleet's KV; a list in tests)."""

    async def record(self, in_flight: InflightRecord) -> int:
        """Store ``in_flight``; return its revision."""
        ...
