"""Engines for the benchmark's agents: a null engine, and a timing wrapper.

:class:`NullEngine` does nothing but remember its adapter list (the agent
checks its read-back), so an update through it costs only the control plane.
:class:`TimedEngine` wraps any driver and notes, in a :class:`EngineTimes`
shared by every agent of a process, when the first engine started to pause,
when the last one finished resuming and how long the slowest load took: the
pause window as the engines see it, on the wall clock that every process of
the machine shares. It also counts, per worker, how many times each engine
went from running to paused (a pause of a paused engine is no transition):
the tenants series' pauses per round.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from lorabus.agents import EngineDriver
from lorabus.errors import CanaryFailed


class NullEngine:
    """An engine driver that answers at once and holds no weights; a load may be
    given a latency (``load_latency_s +- load_jitter_s``, drawn per load) to see
    the pause window without any HTTP."""

    kind = "null"

    def __init__(
        self,
        *,
        load_latency_s: float = 0.0,
        load_jitter_s: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self._adapters: dict[str, None] = {}
        self.peak = 0
        """The most adapters it held at once since :meth:`take_peak`."""
        self._latency = load_latency_s
        self._jitter = load_jitter_s
        self._rng = rng or random.Random(0)

    async def pause(self) -> None:
        pass

    async def resume(self) -> None:
        pass

    async def load_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        if self._latency > 0:
            jitter = self._rng.uniform(-self._jitter, self._jitter)
            await asyncio.sleep(max(0.0, self._latency + jitter))
        self._adapters[name] = None
        self.peak = max(self.peak, len(self._adapters))

    def take_peak(self) -> int:
        """The most adapters it held at once since the last take; from now, what it holds."""
        peak, self.peak = self.peak, len(self._adapters)
        return peak

    async def unload_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)

    async def list_adapters(self) -> list[str]:
        return list(self._adapters)

    async def canary(self, name: str, *, budget_s: float) -> str:
        if name not in self._adapters:
            raise CanaryFailed(f"the null engine holds no {name!r}")
        return ""

    async def aclose(self) -> None:
        pass


class EngineTimes:
    """What the engines of one process went through since the last :meth:`take`."""

    def __init__(self) -> None:
        self.first_pause: float | None = None
        self.last_resume: float | None = None
        self.slowest_load_s = 0.0
        self.pauses = 0
        self.resumes = 0
        self.transitions: dict[str, int] = {}
        """Worker id -> running-to-paused transitions since :meth:`take_transitions`."""

    def _clear(self) -> None:
        self.first_pause = self.last_resume = None
        self.slowest_load_s = 0.0
        self.pauses = self.resumes = 0

    def paused(self, started: float) -> None:
        self.pauses += 1
        if self.first_pause is None or started < self.first_pause:
            self.first_pause = started

    def resumed(self, ended: float) -> None:
        self.resumes += 1
        if self.last_resume is None or ended > self.last_resume:
            self.last_resume = ended

    def loaded(self, took_s: float) -> None:
        self.slowest_load_s = max(self.slowest_load_s, took_s)

    def paused_from_running(self, worker_id: str) -> None:
        self.transitions[worker_id] = self.transitions.get(worker_id, 0) + 1

    def take_transitions(self) -> dict[str, int]:
        """Each worker's running-to-paused transitions so far (workers with none
        left out); starts counting them afresh. :meth:`take` leaves them be."""
        taken, self.transitions = self.transitions, {}
        return taken

    def take(self) -> dict[str, Any]:
        """The figures so far, as JSON; starts counting afresh."""
        figures = {
            "first_pause": self.first_pause,
            "last_resume": self.last_resume,
            "slowest_load_s": self.slowest_load_s,
            "pauses": self.pauses,
            "resumes": self.resumes,
        }
        self._clear()
        return figures


class TimedEngine:
    """Delegates to ``driver`` and notes pause, resume and load times in ``times``,
    and ``worker_id``'s engine going from running to paused."""

    def __init__(self, driver: EngineDriver, times: EngineTimes, worker_id: str = "") -> None:
        self.driver = driver
        self.times = times
        self.kind = driver.kind
        self.worker_id = worker_id
        self._paused = False

    async def pause(self) -> None:
        self.times.paused(time.time())
        await self.driver.pause()
        if not self._paused:
            self._paused = True
            self.times.paused_from_running(self.worker_id)

    async def resume(self) -> None:
        await self.driver.resume()
        self._paused = False
        self.times.resumed(time.time())

    async def load_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        started = time.monotonic()
        try:
            await self.driver.load_adapter(name, path, budget_s=budget_s)
        finally:
            self.times.loaded(time.monotonic() - started)

    async def unload_adapter(self, name: str) -> None:
        await self.driver.unload_adapter(name)

    async def list_adapters(self) -> list[str]:
        return await self.driver.list_adapters()

    async def canary(self, name: str, *, budget_s: float) -> str:
        return await self.driver.canary(name, budget_s=budget_s)

    async def aclose(self) -> None:
        await self.driver.aclose()
