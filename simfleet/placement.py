"""Which workers the simulated frontend runs a generation on.

Dynamo's frontend routes a request only among the workers that hold its model
(the base model is held by all), round-robin, or to exactly the worker a
request names. A fleet without prefill workers is aggregated: one worker does
all of a request, and ``nvext.decode_worker_id`` (else
``nvext.backend_instance_id``) names it. A fleet with any prefill worker
(``SimWorker.role``, Dynamo's ``--disaggregation-mode prefill``) is
disaggregated: every request needs a prefill worker and a decode worker that
both hold its model, the first among the prefill workers (or exactly
``nvext.prefill_worker_id``), the second among the others, which register
under the same ``backend`` component as aggregated ones (or exactly
``nvext.decode_worker_id``, else ``nvext.backend_instance_id``). A named
worker that does not hold the model leaves no choice: "Model not found".

A request is held while a chosen worker is paused, for at most
``paused_wait_s``; once they all run again it is placed anew, as a worker may
have dropped the adapter meanwhile. The outcome is one :class:`Placement` or
one :class:`Refusal`, which the route module answers in the frontend's words.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .state import SimWorker

__all__ = ["Placement", "Placer", "Refusal", "Targets"]


@dataclass(frozen=True)
class Placement:
    """The workers a request runs on (the same one twice when aggregated)."""

    prefill: SimWorker
    decode: SimWorker

    @property
    def workers(self) -> tuple[SimWorker, ...]:
        """Each chosen worker once."""
        if self.prefill is self.decode:
            return (self.decode,)
        return (self.prefill, self.decode)


@dataclass(frozen=True)
class Refusal:
    """Why a request has no placement: an HTTP status and the frontend's message."""

    status: int
    message: str


@dataclass(frozen=True)
class Targets:
    """The instance ids a request names (``nvext``), None where it names none."""

    prefill: int | None = None
    decode: int | None = None


#: The workers a half of a placement chooses from: all (aggregated), the
#: prefill workers, or the others.
_Pool = Literal["any", "prefill", "decode"]
#: The words of "no such worker" for each pool.
_POOL_WORDS = {"any": "worker", "prefill": "prefill worker", "decode": "decode worker"}


@dataclass(frozen=True)
class _Side:
    """One half of a placement: the pool it chooses from, or the one worker named."""

    pool: _Pool
    target: SimWorker | None


class Placer:
    """Places requests on a fleet's workers; keeps the round-robin turns."""

    def __init__(self, workers: Mapping[str, SimWorker], *, base_model: str, paused_wait_s: float):
        self._workers = workers
        self._base_model = base_model
        self._paused_wait_s = paused_wait_s
        self._turns: dict[tuple[_Pool, str], itertools.count[int]] = {}

    def disaggregated(self) -> bool:
        """Whether requests need a prefill and a decode worker."""
        return any(w.role == "prefill" for w in self._workers.values())

    async def place(self, model: str, targets: Targets) -> Placement | Refusal:
        """The workers for ``model``, once none of them is paused."""
        if self.disaggregated():
            prefill = self._side("prefill", targets.prefill)
            decode = self._side("decode", targets.decode)
        else:
            prefill = decode = self._side("any", targets.decode)
        if isinstance(prefill, Refusal):
            return prefill
        if isinstance(decode, Refusal):
            return decode
        try:
            async with asyncio.timeout(self._paused_wait_s):
                while True:
                    placement = self._choose(model, prefill, decode)
                    if placement is None:
                        return Refusal(404, "Model not found")
                    for worker in placement.workers:
                        if not await worker.wait_resumed():
                            return Refusal(503, "simulated fleet is stopping")
                    # One may have dropped the adapter while paused: place again.
                    if self._holds(prefill, placement.prefill, model) and self._holds(
                        decode, placement.decode, model
                    ):
                        return placement
        except TimeoutError:
            message = f"worker for model '{model}' stayed paused for {self._paused_wait_s} s"
            return Refusal(503, message)

    def _side(self, pool: _Pool, target: int | None) -> _Side | Refusal:
        if target is None:
            return _Side(pool, None)
        named = next((w for w in self._pool(pool) if w.instance_id == target), None)
        if named is None:
            return Refusal(404, f"No {_POOL_WORDS[pool]} with instance id {target}")
        return _Side(pool, named)

    def _choose(self, model: str, prefill: _Side, decode: _Side) -> Placement | None:
        first = self._pick(prefill, model)
        if first is None:
            return None
        second = first if decode is prefill else self._pick(decode, model)
        if second is None:
            return None
        return Placement(first, second)

    def _pick(self, side: _Side, model: str) -> SimWorker | None:
        if side.target is not None:
            return side.target if self._holds(side, side.target, model) else None
        holders = self._holders(side.pool, model)
        if not holders:
            return None
        turn = next(self._turns.setdefault((side.pool, model), itertools.count()))
        return holders[turn % len(holders)]

    def _holds(self, side: _Side, worker: SimWorker, model: str) -> bool:
        return worker in self._holders(side.pool, model)

    def _holders(self, pool: _Pool, model: str) -> list[SimWorker]:
        return [w for w in self._pool(pool) if model == self._base_model or model in w.adapters]

    def _pool(self, pool: _Pool) -> list[SimWorker]:
        workers = self._workers.values()
        if pool == "prefill":
            return [w for w in workers if w.role == "prefill"]
        if pool == "decode":
            return [w for w in workers if w.role != "prefill"]
        return list(workers)
