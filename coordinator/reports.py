"""What the coordinator says of input it does not take as given.

A request that does not decode, or whose reply subject is no inbox; a record
of the store that does not decode; a setting of the fleet's streams that
lorabus would not have made. Each is logged, with the epoch, where it is
handled, and audited as a ``bad_message`` event, at most ``_BAD_EVENTS_PER_S``
a second, so that junk cannot flood the audit trail too. A tenant's request
refused for what it asked (``tenants.py``) is a ``request_refused`` event,
within a budget of that tenant's own, as many a second: no tenant's flood
of refused requests keeps another's refusals, or junk, out of the trail
(those of names no tenant has share the common budget). (Heartbeats and
acks are reported by ``bus.py``, on a budget of their own.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from nats.aio.msg import Msg

from lorabus.bus.rate_limit import PerSecond
from lorabus.coordinator.ports import CommandBus
from lorabus.coordinator.store import CorruptRecord
from lorabus.schemas import BadMessage, ErrorInfo, RequestRefused, Subjects

log = logging.getLogger(__name__)

_BAD_EVENTS_PER_S = 10
"""Malformed requests are all answered and logged; this many a second are also
``bad_message`` events."""


class Reports:
    def __init__(
        self,
        bus: CommandBus,
        subjects: Subjects,
        epoch: Callable[[], int],
        *,
        tenants: Iterable[str] = (),
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self._epoch = epoch
        self._budget = PerSecond(_BAD_EVENTS_PER_S)
        self._tenant_budgets = {name: PerSecond(_BAD_EVENTS_PER_S) for name in tenants}
        """One per tenant the coordinator knows (a bounded set)."""

    async def bad_request(self, msg: Msg, error: str) -> None:
        """A request that is not served as sent (it does not decode, or its
        reply subject is no inbox)."""
        size = len(msg.data)
        log.warning("epoch=%d %s (%d bytes on %s)", self._epoch(), error, size, msg.subject)
        await self.bad(msg.subject, error[:1024], size)

    async def corrupt(self, corrupt: CorruptRecord, *, remedy: str) -> None:
        """A record of the store that does not decode, and what is done about
        it (audited on the record's KV subject)."""
        error = f"{corrupt}; {remedy}; it began {corrupt.excerpt}"[:1024]
        log.error("epoch=%d %s", self._epoch(), error)
        await self.bad(f"$KV.{self.subjects.state_bucket()}.{corrupt.key}", error, 0)

    async def bad(self, subject: str, error: str, size: int) -> None:
        """The ``bad_message`` event alone, within the budget."""
        if self._budget.take():
            await self.bus.emit(
                BadMessage(
                    ts=time.time(),
                    source="coordinator",
                    epoch=self._epoch(),
                    subject=subject[:256],
                    error=error,
                    size=size,
                )
            )

    async def refused(
        self, tenant: str, kind: str, update_id: str, adapter: str, error: ErrorInfo
    ) -> None:
        """A tenant's request refused for what it asked: not its own, or past a quota."""
        log.warning(
            "epoch=%d tenant=%s %s %s refused: %s", self._epoch(), tenant, kind, update_id, error
        )
        if self._tenant_budgets.get(tenant, self._budget).take():
            await self.bus.emit(
                RequestRefused(
                    ts=time.time(),
                    source="coordinator",
                    epoch=self._epoch(),
                    tenant=tenant,
                    kind=kind,
                    update_id=update_id,
                    adapter=adapter[:128],
                    error=error,
                )
            )
