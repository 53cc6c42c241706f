"""What the coordinator's parts signal to each other, never to users.

Each is a :class:`~lorabus.errors.LorabusError` so that an update it ends
answers with its code (``not_leader`` makes a client ask again), but none is
in the public tree: a user of ``lorabus`` only ever sees that code in a
result.
"""

from __future__ import annotations

from lorabus.errors import ErrorCode, LorabusError


class StoreUnavailable(LorabusError):
    """Raised when the fleet's KV store cannot be read or written in time."""


class LeadershipLost(LorabusError):
    """Raised when this coordinator no longer holds the fleet's lease."""

    code = ErrorCode.NOT_LEADER


class LostRace(LeadershipLost):
    """Raised when a compare-and-set finds that another coordinator wrote first."""


class SteppedAside(LeadershipLost):
    """Raised when a coordinator gives its lease up so that a standby may lead
    instead: it campaigns again only after two leases of silence, behind any
    standby (which waits one)."""
