"""Prometheus metrics of an agent: how its engine calls go, per operation, and
how the housekeeping of its node's adapter cache goes.

:func:`instrumented` wraps any engine driver, so the drivers stay free of
metrics code and every engine kind is measured the same way; the wrapper
offers what the driver offers (an in-place replace only where it has one).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lorabus.agents.engine import CacheReset, EngineDriver, InPlaceReplace, SetupCheck

_T = TypeVar("_T")
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.call_seconds = Histogram(
            "lorabus_engine_call_seconds",
            "Engine calls by operation and worker (a node agent drives several).",
            ["operation", "worker"],
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.call_errors = Counter(
            "lorabus_engine_call_errors",
            "Failed engine calls by operation and worker.",
            ["operation", "worker"],
            registry=self.registry,
        )
        self.bus_connected = Gauge(
            "lorabus_bus_connected",
            "1 while this process is connected to NATS, else 0 (waiting for it, reconnecting).",
            registry=self.registry,
        )
        self.cache_removed = Counter(
            "lorabus_adapter_cache_removed",
            "Adapters this agent's prunes removed from the node's adapter cache.",
            registry=self.registry,
        )
        self.cache_errors = Counter(
            "lorabus_adapter_cache_errors",
            "Housekeeping of the node's adapter cache that failed, by operation "
            "(prune; remove: an entry a prune may not remove; hold: writing the "
            "holder file); tried again later.",
            ["operation"],
            registry=self.registry,
        )
        for operation in ("prune", "remove", "hold"):
            self.cache_errors.labels(operation)  # at 0 from the start, for rate()

    def cache_pruned(self, removed: int) -> None:
        """A prune of the adapter cache ended, having removed ``removed`` entries."""
        self.cache_removed.inc(removed)

    def cache_failed(self, operation: str) -> None:
        """Housekeeping of the adapter cache failed (to be tried again)."""
        self.cache_errors.labels(operation).inc()


class InstrumentedDriver:
    """An engine driver that times every call of the driver it wraps."""

    def __init__(self, driver: EngineDriver, metrics: AgentMetrics, worker_id: str) -> None:
        self.driver = driver
        self.metrics = metrics
        self.worker_id = worker_id
        self.kind = driver.kind
        self.unload_waits_for_running = getattr(driver, "unload_waits_for_running", False)

    @property
    def capacity(self) -> int | None:
        """What the wrapped driver learnt of its engine's capacity (SGLang's
        server info), read each time: it learns it at its set-up checks."""
        return getattr(self.driver, "capacity", None)

    @property
    def data_parallel(self) -> int:
        """The wrapped driver's data-parallel ranks, as it last found them."""
        return getattr(self.driver, "data_parallel", 1)

    async def pause(self) -> None:
        await self._timed("pause", self.driver.pause)

    async def resume(self) -> None:
        await self._timed("resume", self.driver.resume)

    async def load_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        await self._timed("load", lambda: self.driver.load_adapter(name, path, budget_s=budget_s))

    async def unload_adapter(self, name: str) -> None:
        await self._timed("unload", lambda: self.driver.unload_adapter(name))

    async def list_adapters(self) -> list[str]:
        return await self._timed("list", self.driver.list_adapters)

    async def canary(self, name: str, *, budget_s: float) -> str:
        return await self._timed("canary", lambda: self.driver.canary(name, budget_s=budget_s))

    async def reset_cache(self, *, budget_s: float) -> None:
        """The wrapped driver's, if it has one (else nothing to reset)."""
        driver = self.driver
        if isinstance(driver, CacheReset):
            await self._timed("reset", lambda: driver.reset_cache(budget_s=budget_s))

    async def setup_problem(self) -> str | None:
        if not isinstance(self.driver, SetupCheck):
            return None
        return await self._timed("setup", self.driver.setup_problem)

    async def aclose(self) -> None:
        await self.driver.aclose()

    async def _timed(self, operation: str, call: Callable[[], Awaitable[_T]]) -> _T:
        started = time.perf_counter()
        try:
            return await call()
        except Exception:
            self.metrics.call_errors.labels(operation, self.worker_id).inc()
            raise
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.call_seconds.labels(operation, self.worker_id).observe(elapsed)


class _InstrumentedReplacing(InstrumentedDriver):
    """:class:`InstrumentedDriver` of a driver that replaces in place."""

    async def replace_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        driver = self.driver
        assert isinstance(driver, InPlaceReplace)
        await self._timed("replace", lambda: driver.replace_adapter(name, path, budget_s=budget_s))


def instrumented(driver: EngineDriver, metrics: AgentMetrics, worker_id: str) -> InstrumentedDriver:
    """``driver`` of worker ``worker_id``, every call timed into ``metrics``."""
    if isinstance(driver, InPlaceReplace):
        return _InstrumentedReplacing(driver, metrics, worker_id)
    return InstrumentedDriver(driver, metrics, worker_id)
