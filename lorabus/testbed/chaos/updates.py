"""The update loop of a chaos run: one RL step after another, asked until answered.

Each step writes a real PEFT adapter, pushes it to the fleet's object store
(or, by path, leaves it where agents read it: ``adapters.py``) and asks for
it with a fixed update id. An attempt that hears nothing final
(``timeout``, ``no_coordinator``, ``not_leader``, or the bus itself failing
while NATS restarts) is repeated with the same id, as an orchestrator
would, until a terminal result or the retry bound. Steps are spaced by a
seeded gap, now and then (often after a failed step) one longer than the
pause lease and its grace, so that an engine left paused is not hidden by
the next update resuming it.

The frozen-leader fault asks for one more update through :meth:`UpdateLoop.
request_once`: one client call, never repeated here, while the loop's own
step may be running. The loop stays one step at a time; that request is a
second requester (an operator's ``lorabus update`` beside the trainer), which
the coordinator queues like any other. Its version is the loop's next step,
so versions keep rising in the order they are asked, and whichever of two
queued requests is older is answered ``superseded``: a terminal result.

With several tenants (``--tenants``) each trainer runs a loop of its own on
its own adapter, all at once (:mod:`lorabus.testbed.chaos.tenants`); the
first tenant's loop decides when the fleet goes quiet, and the others wait
for its quiet windows (:mod:`lorabus.testbed.chaos.quiet`) instead of idling
on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable

import nats.errors

from lorabus.client import UpdateClient
from lorabus.errors import LorabusError
from lorabus.schemas import UpdateResult
from lorabus.testbed.chaos.adapters import StepAdapters
from lorabus.testbed.chaos.quiet import QuietWindows
from lorabus.testbed.chaos.timeline import DEFAULT_ADAPTER, Timeline, UpdateRecord, now
from lorabus.testbed.chaos.verdict import is_terminal

log = logging.getLogger(__name__)

ADAPTER = DEFAULT_ADAPTER
_RETRY_PAUSE_S = 0.2
_IDLE_AFTER_FAILURE = 0.75
_HUNG_AFTER_S = 10.0
"""Past its own timeout, a call still not returned is given up on as hung."""


class UpdateLoop:
    def __init__(
        self,
        client: UpdateClient,
        timeline: Timeline,
        adapters: StepAdapters,
        *,
        seed: int,
        run_id: str,
        attempt_timeout_s: float,
        retry_bound_s: float,
        idle_chance: float,
        idle_s: float,
        out: Callable[[str], None],
        adapter: str = ADAPTER,
        tenant: int = 0,
        quiet: QuietWindows | None = None,
    ) -> None:
        """``run_id`` prefixes its update ids; ``tenant`` (its index) seeds its
        gaps (0: as a run with one trainer); ``quiet``: the windows the first
        tenant's loop holds and the others wait for (None: idle on its own)."""
        self.client = client
        self.timeline = timeline
        self.adapters = adapters
        self.run_id = run_id
        self.attempt_timeout_s = attempt_timeout_s
        self.retry_bound_s = retry_bound_s
        self.idle_chance = idle_chance
        self.idle_s = idle_s
        self.out = out
        self.step = 0
        self.adapter = adapter
        self.tenant = tenant
        self.quiet = quiet
        self._rng = random.Random(f"{seed}-updates-{tenant}" if tenant else f"{seed}-updates")

    async def run_until(self, deadline: float, also: asyncio.Task[None] | None = None) -> None:
        """Run steps with their gaps until ``deadline`` has passed and ``also`` is done."""

        def running() -> bool:
            return now() < deadline or (also is not None and not also.done())

        while running():
            async with self._stepping():
                record = await self.run_step()
            # An orchestrator backs off after a failure; that is also when an
            # engine left paused would otherwise be resumed by the next update.
            failed = record.result is None or not record.result.committed
            idle_chance = max(self.idle_chance, _IDLE_AFTER_FAILURE) if failed else self.idle_chance
            idle = self._rng.random() < idle_chance
            gap = self._rng.uniform(0.05, 0.6)
            if idle and now() + self.idle_s < deadline:
                if self.quiet is None:
                    gap = self.idle_s
                elif self.tenant == 0:
                    await self.quiet.hold(self.idle_s)  # the whole fleet goes quiet
                    continue
            # Pacing between RL steps: a time, not a condition.
            await asyncio.sleep(gap)

    @contextlib.asynccontextmanager
    async def _stepping(self) -> AsyncIterator[None]:
        if self.quiet is None:
            yield
            return
        async with self.quiet.step():
            yield

    async def run_step(self, *, recovery: bool = False) -> UpdateRecord:
        self.step += 1
        step = self.step
        update_id = f"{self.run_id}-step-{step}"
        record = UpdateRecord(
            update_id=update_id, version=step, path="", requested_at=now(), adapter=self.adapter
        )
        self.timeline.updates.append(record)
        if recovery:
            self.timeline.recovery_ids.add(update_id)
        give_up_at = record.requested_at + self.retry_bound_s
        path, why = await self.adapters.prepare(step, give_up_at=give_up_at)
        if path is None:
            record.attempts.append(f"never sent: its push failed until the retry bound ({why})")
            self._report(record)
            return record
        record.path, record.sent_at = path, now()
        while True:
            remaining = give_up_at - now()
            result = await self._attempt(update_id, path, step, max(0.5, remaining))
            if result is None:
                record.attempts.append("bus_error")
            else:
                if self._take(record, result):
                    break
            if now() >= give_up_at:
                break
            await asyncio.sleep(_RETRY_PAUSE_S)
        self._report(record)
        return record

    async def request_once(self, timeout_s: float, *, frozen_leader: str) -> UpdateRecord | None:
        """Ask for the next version with ONE ``UpdateClient.update`` call and record
        what it returned: whatever it is, it is not asked again here (the
        invariant ``frozen_leader_request`` judges it). Its adapter is pushed
        first (by bus); if that fails for a whole timeout, nothing is asked."""
        self.step += 1
        step = self.step
        update_id = f"{self.run_id}-once-{step}"
        path, why = await self.adapters.prepare(step, give_up_at=now() + timeout_s, variety=False)
        if path is None:
            self.out(f"update {update_id}: not asked, its push failed ({why})")
            return None
        record = UpdateRecord(
            update_id=update_id,
            version=step,
            path=path,
            requested_at=now(),
            one_call_timeout_s=timeout_s,
            frozen_leader=frozen_leader,
            adapter=self.adapter,
        )
        record.sent_at = record.requested_at
        self.timeline.updates.append(record)
        try:
            async with asyncio.timeout(timeout_s + _HUNG_AFTER_S):
                result = await self.client.update(
                    self.adapter, path, version=step, update_id=update_id, timeout_s=timeout_s
                )
        except TimeoutError:
            record.attempts.append(f"hung: no return within {timeout_s + _HUNG_AFTER_S:.0f}s")
        except (nats.errors.Error, LorabusError) as exc:
            record.attempts.append(f"raised {type(exc).__name__}: {exc}")
        else:
            self._take(record, result)
        record.call_s = now() - record.requested_at
        self._report(record)
        return record

    def _take(self, record: UpdateRecord, result: UpdateResult) -> bool:
        """Record an attempt's answer; True when it is the update's terminal one."""
        record.attempts.append(_attempt_text(result))
        if not is_terminal(result):
            return False
        record.result, record.answered_at = result, now()
        if result.committed:
            self.adapters.committed_version = max(self.adapters.committed_version, record.version)
        return True

    async def ask_again(self, record: UpdateRecord) -> None:
        """Ask once more for a finished update's id: the answer must not change."""
        if record.result is None:
            return
        record.asked_again = await self._attempt(
            record.update_id, record.path, record.version, self.attempt_timeout_s
        )

    async def _attempt(
        self, update_id: str, path: str, version: int, timeout_s: float
    ) -> UpdateResult | None:
        try:
            return await self.client.update(
                self.adapter,
                path,
                version=version,
                update_id=update_id,
                timeout_s=min(self.attempt_timeout_s, timeout_s),
            )
        except nats.errors.Error as exc:
            log.info("update=%s attempt failed on the bus: %r", update_id, exc)
            return None

    def _report(self, record: UpdateRecord) -> None:
        result = record.result
        tries = f" after {len(record.attempts)} attempts" if len(record.attempts) > 1 else ""
        if record.one_call:
            tries = f" from one call in {record.call_s or 0.0:.1f}s"
        if result is None:
            self.out(f"update {record.update_id}: NO TERMINAL RESULT{tries}")
        elif result.committed:
            took = sum(result.phases.values())
            self.out(f"update {record.update_id}: committed {result.adapter} in {took:.2f}s{tries}")
        else:
            error = result.error
            why = f"{error.code}: {error.message[:160]}" if error else "?"
            self.out(f"update {record.update_id}: failed [{why}]{tries}")


def _attempt_text(result: UpdateResult) -> str:
    if result.committed or result.error is None:
        return result.status
    return f"{result.status}:{result.error.code}"
