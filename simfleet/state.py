"""The mutable state of one simulated worker, and how to wait on it.

Each worker plays one engine kind (``engine``: Dynamo, vLLM or SGLang); its
routes answer as that engine does, and its state is the same whatever the kind.
How its engine was started (:class:`EngineSetup`: the flags that decide which
routes it serves and which requests it refuses) is set apart from the faults
injected into it.

Routes change a worker (adapters, pause flag, faults) and tests observe it. All
changes go through :class:`SimWorker` methods so that each one wakes whoever
waits in :meth:`SimWorker.wait_until`: hung requests wait for ``hang`` to clear,
generation requests wait for a resume, tests wait for a request to arrive.
Nothing here polls or sleeps to find out that something changed.

A vLLM engine started with data parallelism (``EngineSetup.data_parallel_size``)
runs one engine per DP rank behind ``api_server_count`` API servers, and each
API server keeps its own LoRA registry (vLLM's ``OpenAIServingModels``): a load
reaches every rank but is registered only by the API server that answered it.
``adapters`` stays the worker's one list of what it holds (every engine kind
reads it); :attr:`SimWorker.adapter_ranks` and
:attr:`SimWorker.adapter_api_servers` narrow it down for an adapter that only
some ranks hold or only some API servers know, and say nothing about the rest
(held everywhere, known everywhere), so that a worker without data parallelism
never needs them.

Waking works by pulsing an :class:`asyncio.Event`: ``_notify`` sets the current
event and replaces it with a fresh one, so every waiter re-checks its condition
exactly once per change. :meth:`SimWorker.release` (called when the fleet
stops) wakes everyone for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from .identity import instance_id_for, lora_id_for

__all__ = [
    "ENGINES",
    "LOAD_ROUTES",
    "OPERATIONS",
    "REQUEST_LOG_LIMIT",
    "ROLES",
    "EngineSetup",
    "RecordedRequest",
    "SimWorker",
    "WorkerFaults",
]

#: Engine kinds a simulated worker can play (the agent's ``--engine`` choices).
ENGINES = ("dynamo", "vllm", "sglang")
#: What a Dynamo worker does for a request: all of it, or one half of a
#: disaggregated one (Dynamo's ``--disaggregation-mode`` agg, prefill, decode).
ROLES = ("aggregated", "prefill", "decode")
#: Each engine kind's load request, as the worker's request log records it.
LOAD_ROUTES = {
    "dynamo": ("POST", "/v1/loras"),
    "vllm": ("POST", "/v1/load_lora_adapter"),
    "sglang": ("POST", "/load_lora_adapter"),
}

#: Requests a worker remembers: the most recent ones, so that a long run (the
#: benchmark, the chaos suite) does not grow without bound.
REQUEST_LOG_LIMIT = 4096

#: Worker operations that a latency can be injected into.
OPERATIONS = frozenset({"pause", "resume", "load", "unload", "list", "health"})


@dataclass
class WorkerFaults:
    """Misbehaviour injected into one worker."""

    #: Seconds to wait before handling each operation (keys from ``OPERATIONS``).
    latency_s: dict[str, float] = field(default_factory=dict)
    #: The next N loads that would succeed answer an injected error instead.
    fail_next_loads: int = 0
    #: HTTP status of an injected load error: 500 (a handler failure), or e.g.
    #: 503 (a worker or proxy not ready), or a 4xx (a refusal agents do not retry).
    load_failure_status: int = 500
    #: The next N unloads of a name the worker has answer an injected error instead.
    fail_next_unloads: int = 0
    #: Every request to the worker waits until this is cleared.
    hang: bool = False
    #: Failed loads answer HTTP 200 with ``{"status": "error"}`` (older Dynamo).
    status_error_quirk: bool = False
    #: Adapters with generation requests in flight. Dynamo 1.6.1's vLLM handler
    #: then refuses a pause in ``keep`` mode; ``wait`` and ``abort`` drain them.
    busy_loras: list[str] = field(default_factory=list)
    #: Adapters the worker lists and loads, but that its generations do not
    #: know (a stale registration, as in Dynamo issue #11163): a generation for
    #: one answers as for an unknown name, on every engine kind.
    unroutable: list[str] = field(default_factory=list)
    #: vLLM data parallelism: DP ranks a load never reaches. A load that
    #: succeeds still registers the name, but these ranks do not hold the
    #: adapter, and a generation placed on one of them fails.
    load_misses_ranks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.latency_s) - OPERATIONS)
        if unknown:
            raise ValueError(f"unknown operations in latency_s: {unknown}")
        negative = sorted(op for op, seconds in self.latency_s.items() if seconds < 0)
        if negative:
            raise ValueError(f"negative latency for: {negative}")
        for name in ("fail_next_loads", "fail_next_unloads"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        blank = [name for name in self.unroutable if not isinstance(name, str) or not name]
        if blank:
            raise ValueError(f"unroutable names must be non-empty strings, got {blank}")
        bad_ranks = [
            rank
            for rank in self.load_misses_ranks
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0
        ]
        if bad_ranks:
            raise ValueError(f"load_misses_ranks must be ranks (ints >= 0), got {bad_ranks}")
        if not 400 <= self.load_failure_status <= 599:
            raise ValueError(
                f"load_failure_status must be an HTTP error (400-599), "
                f"got {self.load_failure_status}"
            )


@dataclass
class EngineSetup:
    """How a worker's engine was started; each engine kind reads its own flags."""

    #: vLLM: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (without it vLLM mounts no
    #: ``/v1/load_lora_adapter`` nor ``/v1/unload_lora_adapter``).
    lora_updating: bool = True
    #: vLLM: ``VLLM_SERVER_DEV_MODE=1`` (without it no ``/pause``, ``/resume``,
    #: ``/is_paused``).
    dev_mode: bool = True
    #: SGLang: ``--admin-api-key``; its control routes take this key and not the
    #: fleet's API key, its other routes the API key and not this one.
    admin_api_key: str | None = None
    #: SGLang: ``--dp-size``; above 1, LoRA loads and unloads fail with a bare 500.
    dp_size: int = 1
    #: SGLang: ``--max-loaded-loras``; a load beyond it unloads the least recently
    #: loaded other adapters, and still succeeds.
    max_loaded_loras: int | None = None
    #: SGLang: whether its server info shows ``max_loaded_loras`` (an older
    #: release's does not: its agent then knows no capacity, and meets the
    #: evictions).
    shows_max_loaded_loras: bool = True
    #: vLLM: ``--data-parallel-size``; one engine per DP rank, each holding its
    #: own adapters, a completion placed on one of them.
    data_parallel_size: int = 1
    #: vLLM: ``--api-server-count`` (with data parallelism vLLM starts one per
    #: rank by default); each keeps its own LoRA registry, and requests go to
    #: them in turn.
    api_server_count: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_size", "data_parallel_size", "api_server_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_loaded_loras is not None and self.max_loaded_loras < 1:
            raise ValueError(f"max_loaded_loras must be >= 1, got {self.max_loaded_loras}")


@dataclass(frozen=True)
class RecordedRequest:
    """One HTTP request as a worker received it."""

    method: str
    #: Path relative to the worker's system URL, e.g. ``/v1/loras``.
    path: str
    #: Header names lower-cased.
    headers: dict[str, str]
    #: The body parsed as JSON, or None when empty or not JSON.
    body: Any
    ts: float
    #: The path as it arrived, percent-encoding kept (``path`` is decoded).
    raw_path: str = ""


class SimWorker:
    """One simulated worker: its adapters, pause flag, faults and request log."""

    def __init__(
        self,
        worker_id: str,
        world_size: int,
        *,
        faults: WorkerFaults | None = None,
        engine: str = "dynamo",
        base_model: str = "sim-base",
        setup: EngineSetup | None = None,
        role: str = "aggregated",
    ):
        if engine not in ENGINES:
            raise ValueError(f"engine of {worker_id} must be one of {ENGINES}, got {engine!r}")
        if role not in ROLES:
            raise ValueError(f"role of {worker_id} must be one of {ROLES}, got {role!r}")
        if not worker_id or "/" in worker_id:
            raise ValueError(f"worker id must be non-empty and without '/': {worker_id!r}")
        if world_size < 1:
            raise ValueError(f"world size of {worker_id} must be >= 1, got {world_size}")
        self.worker_id = worker_id
        self.world_size = world_size
        self.instance_id = instance_id_for(worker_id)
        #: The engine kind this worker plays: which routes it serves, how it answers.
        self.engine = engine
        #: Its part of a request behind Dynamo's frontend (one of ``ROLES``).
        self.role = role
        #: The model the engine serves (vLLM and SGLang list it, and adapters' parent).
        self.base_model = base_model
        #: Loaded adapters: name -> lora_id.
        self.adapters: dict[str, int] = {}
        #: Where each loaded adapter was loaded from (vLLM and SGLang list it as ``root``).
        self.adapter_paths: dict[str, str] = {}
        #: vLLM data parallelism: the DP ranks that hold an adapter, for one
        #: that not every rank holds (absent: every rank).
        self.adapter_ranks: dict[str, frozenset[int]] = {}
        #: vLLM API servers whose registry knows an adapter, for one that not
        #: every API server knows (absent: every one).
        self.adapter_api_servers: dict[str, frozenset[int]] = {}
        self.faults = faults if faults is not None else WorkerFaults()
        #: How the engine was started (the routes it serves, what it refuses).
        self.setup = setup if setup is not None else EngineSetup()
        #: The most recent requests, oldest first (at most ``REQUEST_LOG_LIMIT``).
        self.requests: list[RecordedRequest] = []
        #: Every request ever recorded, also those no longer in ``requests``.
        self.requests_total = 0
        #: Generation requests currently held back by a pause.
        self.waiting_for_resume = 0
        #: Cache resets the engine performed (vLLM's prefix-cache reset, SGLang's
        #: flush).
        self.cache_resets = 0
        self._api_server_turns = 0
        self._dp_rank_turns = 0
        self._paused = False
        self._changed = asyncio.Event()
        self._released = asyncio.Event()

    def __repr__(self) -> str:
        return (
            f"SimWorker({self.worker_id!r}, world_size={self.world_size}, engine={self.engine!r})"
        )

    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        self._paused = value
        self._notify()

    @property
    def released(self) -> bool:
        """True once the fleet stopped: waits end and requests are refused."""
        return self._released.is_set()

    def set_faults(self, **changes: Any) -> None:
        """Replace some fault fields; raises TypeError/ValueError for bad ones."""
        if "latency_s" in changes:
            changes["latency_s"] = dict(changes["latency_s"])
        for name in ("busy_loras", "unroutable", "load_misses_ranks"):
            if name in changes:
                changes[name] = list(changes[name])
        self.faults = dataclasses.replace(self.faults, **changes)
        self._notify()

    def set_setup(self, **changes: Any) -> None:
        """Change how the engine was started, as a restart with other flags would
        (its adapters are kept: a test that needs them lost removes them);
        raises TypeError/ValueError for bad ones."""
        self.setup = dataclasses.replace(self.setup, **changes)
        self._notify()

    def take_injected_load_failure(self) -> bool:
        """Consume one injected load failure; False when none is pending."""
        if self.faults.fail_next_loads <= 0:
            return False
        self.set_faults(fail_next_loads=self.faults.fail_next_loads - 1)
        return True

    def take_injected_unload_failure(self) -> bool:
        """Consume one injected unload failure; False when none is pending."""
        if self.faults.fail_next_unloads <= 0:
            return False
        self.set_faults(fail_next_unloads=self.faults.fail_next_unloads - 1)
        return True

    def add_adapter(
        self,
        lora_name: str,
        path: str = "",
        *,
        api_server: int | None = None,
        missing_ranks: Collection[int] = (),
    ) -> int:
        """Hold ``lora_name``, loaded from ``path``, on every DP rank but
        ``missing_ranks`` (ranks that held it before keep it).

        ``api_server``: the one vLLM API server that registers the name (beside
        those that knew it already); None: every one, as for an engine without
        several API servers.
        """
        known = lora_name in self.adapters
        ranks = self.ranks_holding(lora_name) if known else frozenset()
        ranks |= self._all_ranks() - frozenset(missing_ranks)
        if api_server is None:
            servers = self._all_api_servers()
        else:
            servers = self.api_servers_knowing(lora_name) if known else frozenset()
            servers |= {api_server}
        lora_id = self.adapters[lora_name] = lora_id_for(lora_name)
        self.adapter_paths[lora_name] = path
        _narrow(self.adapter_ranks, lora_name, ranks, self._all_ranks())
        _narrow(self.adapter_api_servers, lora_name, servers, self._all_api_servers())
        self._notify()
        return lora_id

    def remove_adapter(self, lora_name: str, *, api_server: int | None = None) -> int | None:
        """Drop ``lora_name``; its lora_id, or None when it was not held.

        ``api_server``: unregister it from that vLLM API server only (None when
        that one did not know it); every DP rank drops the adapter, and the
        worker holds it no more once no API server knows it.
        """
        if api_server is not None:
            if not self.registered_in(lora_name, api_server):
                return None
            servers = self.api_servers_knowing(lora_name) - {api_server}
            if servers:
                self.adapter_ranks[lora_name] = frozenset()
                self.adapter_api_servers[lora_name] = servers
                self._notify()
                return self.adapters[lora_name]
        lora_id = self.adapters.pop(lora_name, None)
        self.adapter_paths.pop(lora_name, None)
        self.adapter_ranks.pop(lora_name, None)
        self.adapter_api_servers.pop(lora_name, None)
        self._notify()
        return lora_id

    def ranks_holding(self, lora_name: str) -> frozenset[int]:
        """The DP ranks whose engine holds ``lora_name`` (none when not held)."""
        if lora_name not in self.adapters:
            return frozenset()
        return self.adapter_ranks.get(lora_name, self._all_ranks())

    def api_servers_knowing(self, lora_name: str) -> frozenset[int]:
        """The API servers whose registry knows ``lora_name`` (none when not held)."""
        if lora_name not in self.adapters:
            return frozenset()
        return self.adapter_api_servers.get(lora_name, self._all_api_servers())

    def registered_in(self, lora_name: str, api_server: int) -> bool:
        """Whether API server ``api_server``'s registry knows ``lora_name``."""
        return api_server in self.api_servers_knowing(lora_name)

    def registry(self, api_server: int) -> list[str]:
        """The adapters API server ``api_server`` knows, in load order."""
        return [name for name in self.adapters if self.registered_in(name, api_server)]

    def take_api_server(self) -> int:
        """The API server that answers the next request: each in turn."""
        turn, self._api_server_turns = self._api_server_turns, self._api_server_turns + 1
        return turn % self.setup.api_server_count

    def take_dp_rank(self) -> int:
        """The DP rank of the next generation that names none: each in turn."""
        turn, self._dp_rank_turns = self._dp_rank_turns, self._dp_rank_turns + 1
        return turn % self.setup.data_parallel_size

    def _all_ranks(self) -> frozenset[int]:
        return frozenset(range(self.setup.data_parallel_size))

    def _all_api_servers(self) -> frozenset[int]:
        return frozenset(range(self.setup.api_server_count))

    def reset_cache(self) -> None:
        """Drop the engine's cached prefixes; the sim caches none, it counts."""
        self.cache_resets += 1
        self._notify()

    def record(self, request: RecordedRequest) -> None:
        self.requests.append(request)
        self.requests_total += 1
        if len(self.requests) > REQUEST_LOG_LIMIT + REQUEST_LOG_LIMIT // 4:
            # Trimmed in batches, so that each request costs O(1) on average.
            del self.requests[: len(self.requests) - REQUEST_LOG_LIMIT]
        self._notify()

    def count_requests(self, method: str, path: str) -> int:
        """How many of the remembered requests were ``method path`` (``POST
        /v1/loras`` counts the loads)."""
        return sum((r.method, r.path) == (method, path) for r in self.requests)

    @property
    def loads_received(self) -> int:
        """Load requests among the remembered ones (tried or not), on this
        worker's engine's load route."""
        return self.count_requests(*LOAD_ROUTES[self.engine])

    async def wait_until(self, condition: Callable[[], bool]) -> bool:
        """Wait until ``condition()`` holds; False if the worker is released first.

        The condition is re-checked after every change made through this class
        (direct assignments to ``adapters`` or ``faults`` wake nobody).
        """
        while not condition():
            if self.released:
                return False
            changed = self._changed
            await changed.wait()
        return True

    async def wait_requests(self, count: int) -> bool:
        """Wait until at least ``count`` requests have been recorded in all."""
        return await self.wait_until(lambda: self.requests_total >= count)

    async def wait_resumed(self) -> bool:
        """Hold a generation request while paused; False if released first."""
        if not self.paused:
            return not self.released
        self.waiting_for_resume += 1
        self._notify()
        try:
            return await self.wait_until(lambda: not self.paused)
        finally:
            self.waiting_for_resume -= 1
            self._notify()

    async def delay(self, seconds: float) -> None:
        """Sleep ``seconds`` of injected latency, ending early on release."""
        if seconds <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._released.wait(), seconds)

    def release(self) -> None:
        """End every wait on this worker for good (the fleet is stopping)."""
        self._released.set()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def _narrow(
    narrowed: dict[str, frozenset[int]], name: str, chosen: frozenset[int], every: frozenset[int]
) -> None:
    """Keep ``chosen`` for ``name`` in ``narrowed``, or nothing when it is ``every`` one."""
    if chosen >= every:
        narrowed.pop(name, None)
    else:
        narrowed[name] = chosen
