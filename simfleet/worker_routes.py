"""The control server of each simulated worker, under ``/workers/{id}``.

One aiohttp route table serves every worker: the worker id is a path segment,
so a thousand workers share one port. Each worker plays one engine kind
(``SimWorker.engine``) and answers only that engine's routes, the way that
engine does: the vLLM and SGLang personalities live in :mod:`.vllm_routes` and
:mod:`.sglang_routes`; a path another kind serves gets this kind's 404. The
Dynamo personality, here, is a Dynamo worker's system status server. Its
paths, payloads, status codes, content types and messages follow a real
Dynamo 1.6.1 worker as the ``real_dynamo`` test tier observes it, request for
request, quirks included:

- ``/v1/loras`` answers ``application/json``; a failed load is a JSON 500 (or,
  with ``status_error_quirk``, a 200 whose body says ``"status":"error"``); a
  body that is not JSON is a plain-text 400, JSON of the wrong shape a
  plain-text 422, a request without ``Content-Type: application/json`` a 415.
- ``/engine/...`` routes and ``/health`` answer JSON labelled ``text/plain``;
  an engine route that fails answers **200** with ``"status":"error"``; a body
  that is not JSON is a 400 ``{"error":"Invalid JSON",...}``.
- An unknown ``/engine/<name>`` route is a 404 with a JSON body, any other
  unknown path a plain-text 404.
- It serves no generation route: a Dynamo worker generates what the frontend
  routes to it (:mod:`.frontend_routes`), so ``/v1/completions`` here is an
  unknown path.

Every request is first recorded in the worker's log, then waits out an
injected ``hang`` and latency, then is checked for the bearer token its engine
asks on that route (the fleet's API key, or an SGLang worker's admin key),
then handled.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from . import sglang_routes, vllm_routes
from .http_utils import UNAUTHORIZED, error_reply, is_authorized, plain_text_reply, recorded
from .lora_source import NotAnAdapter, SourceNotFound, check_adapter_dir, resolve_local
from .state import SimWorker

__all__ = ["PERSONALITIES", "WORKER_PREFIX", "Personality", "WorkerRoutes"]

WORKER_PREFIX = "/workers/{worker_id}"

_Handler = Callable[[web.Request, SimWorker, bytes], Awaitable[web.Response]]
_Route = Callable[[web.Request], Awaitable[web.Response]]
_Entry = tuple[str | None, _Handler]


class _LoraSource(msgspec.Struct):
    uri: str


class _LoadLora(msgspec.Struct):
    lora_name: str
    source: _LoraSource


_LOAD_DECODER = msgspec.json.Decoder(_LoadLora)
_PAUSE_MODES = ("keep", "wait", "abort")


def _is_json(request: web.Request) -> bool:
    mime = request.content_type
    return mime == "application/json" or (
        mime.startswith("application/") and mime.endswith("+json")
    )


def _decode_load(request: web.Request, raw: bytes) -> _LoadLora | web.Response:
    # The real runtime (axum's Json extractor) answers a bad body in plain text.
    if not _is_json(request):
        return plain_text_reply(415, "Expected request with `Content-Type: application/json`")
    try:
        return _LOAD_DECODER.decode(raw)
    except msgspec.ValidationError as exc:
        return plain_text_reply(
            422, f"Failed to deserialize the JSON body into the target type: {exc}"
        )
    except msgspec.DecodeError as exc:
        return plain_text_reply(400, f"Failed to parse the request body as JSON: {exc}")


def _engine_reply(body: Any, status: int = 200) -> web.Response:
    """Engine routes and /health: a JSON body that says it is ``text/plain``."""
    return web.Response(status=status, text=json.dumps(body), content_type="text/plain")


def _engine_body(raw: bytes) -> dict[str, Any] | web.Response:
    """An engine route's body: {} when empty, a 400 when not JSON, an error when not an object."""
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as exc:
        return _engine_reply({"error": "Invalid JSON", "message": str(exc)}, status=400)
    if not isinstance(body, dict):
        return _engine_reply({"status": "error", "message": "request body must be a JSON object"})
    return body


def _lora_success(name: str, lora_id: int, message: str) -> web.Response:
    body = {"status": "success", "message": message, "lora_name": name, "lora_id": lora_id}
    return web.json_response(body)


def _load_error(
    worker: SimWorker, message: str, name: str | None = None, *, status: int = 500
) -> web.Response:
    """A failed load; only the engine's own failures name the adapter, as in Dynamo."""
    if worker.faults.status_error_quirk:
        status = 200
    body = {"status": "error", "message": message}
    if name is not None:
        body["lora_name"] = name
    return web.json_response(body, status=status)


class WorkerRoutes:
    """Route table of all workers' system servers."""

    def __init__(self, workers: Mapping[str, SimWorker], *, api_key: str | None):
        self._workers = workers
        self._api_key = api_key

    def routes(self) -> list[web.RouteDef]:
        # One aiohttp route per (method, path) that any engine serves; the
        # worker's engine picks the handler when a request arrives.
        table: dict[tuple[str, str], dict[str, _Entry]] = {}
        for engine, personality in PERSONALITIES.items():
            for method, path, op, handler in personality.routes:
                table.setdefault((method, path), {})[engine] = (op, handler)
        p = WORKER_PREFIX
        defs = [
            web.route(method, f"{p}{path}", self._dispatch(by_engine))
            for (method, path), by_engine in table.items()
        ]
        # Registered last: anything else under a worker, e.g. /engine/<unknown>.
        defs.append(web.route("*", f"{p}/{{tail:.*}}", self._dispatch({})))
        return defs

    def _dispatch(self, by_engine: Mapping[str, _Entry]) -> _Route:
        async def handle(request: web.Request) -> web.Response:
            worker_id = request.match_info["worker_id"]
            worker = self._workers.get(worker_id)
            if worker is None:
                return error_reply(404, "unknown worker")
            raw = await request.read()
            received = recorded(request, raw, prefix=f"/workers/{worker_id}")
            worker.record(received)
            if not await worker.wait_until(lambda: not worker.faults.hang):
                return error_reply(503, "simulated fleet is stopping")
            personality = PERSONALITIES[worker.engine]
            op, handler = by_engine.get(worker.engine, (None, personality.not_found))
            if op is not None:
                await worker.delay(worker.faults.latency_s.get(op, 0.0))
            if worker.released:
                return error_reply(503, "simulated fleet is stopping")
            key = personality.key_for(request.method, received.path, worker, self._api_key)
            if key is not None and not is_authorized(request, key):
                return personality.unauthorized()
            return await handler(request, worker, raw)

        return handle


async def _health(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    return _engine_reply({"status": "ready"})


async def _load(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    load = _decode_load(request, raw)
    if isinstance(load, web.Response):
        return load
    name = load.lora_name
    if not name:
        return _load_error(worker, "'lora_name' is required and must be a string")
    if not load.source.uri:
        return _load_error(worker, "'source.uri' is required and must be a string")
    if name in worker.adapters:
        # Like Dynamo without hot-swap: the source is not looked at again.
        return _lora_success(name, worker.adapters[name], f"LoRA adapter '{name}' already loaded")
    try:
        path = resolve_local(load.source.uri)
    except SourceNotFound as exc:
        return _load_error(worker, f"Failed to download LoRA: Download failed: {exc}")
    try:
        check_adapter_dir(path)
    except NotAnAdapter as exc:
        # Dynamo's vLLM handler around vLLM's LoRAAdapterNotFoundError.
        message = f"Failed to add LoRA '{name}': Loading lora {name} failed: {exc}"
        return _load_error(worker, message, name)
    if worker.take_injected_load_failure():
        message = f"Failed to add LoRA '{name}': injected load failure"
        return _load_error(worker, message, name, status=worker.faults.load_failure_status)
    lora_id = worker.add_adapter(name, path)
    return _lora_success(name, lora_id, f"LoRA adapter '{name}' loaded successfully")


async def _list(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    loras = dict(worker.adapters)
    return web.json_response({"status": "success", "loras": loras, "count": len(loras)})


async def _unload(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    name = request.match_info["lora_name"]
    if name in worker.adapters and worker.take_injected_unload_failure():
        message = f"Failed to remove LoRA '{name}': injected unload failure"
        return web.json_response({"status": "error", "message": message}, status=500)
    lora_id = worker.remove_adapter(name)
    if lora_id is None:
        # Dynamo's Python handler formats the list: a Python repr, in load order.
        available = repr(list(worker.adapters))
        message = f"LoRA adapter '{name}' not found. Available LoRAs: {available}"
        return web.json_response({"status": "error", "message": message}, status=500)
    return _lora_success(name, lora_id, f"LoRA adapter '{name}' unloaded successfully")


async def _pause(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    body = _engine_body(raw)
    if isinstance(body, web.Response):
        return body
    mode, clear_cache = body.get("mode", "keep"), bool(body.get("clear_cache", False))
    if mode not in _PAUSE_MODES:
        message = f"Invalid mode '{mode}'; expected keep|wait|abort"
        return _engine_reply({"status": "error", "message": message})
    busy = sorted(worker.faults.busy_loras)
    if mode == "keep" and busy:
        message = "Cannot pause generation in keep mode with active LoRA requests: "
        return _engine_reply({"status": "error", "message": message + ", ".join(busy)})
    if busy:
        worker.set_faults(busy_loras=[])  # waited for or aborted
    worker.paused = True
    reply = {"status": "ok", "message": "Engine paused", "mode": mode, "clear_cache": clear_cache}
    return _engine_reply(reply)


async def _resume(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    body = _engine_body(raw)
    if isinstance(body, web.Response):
        return body
    worker.paused = False
    return _engine_reply({"status": "ok", "message": "Engine resumed"})


async def _route_not_found(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    tail = request.path.removeprefix(f"/workers/{worker.worker_id}/")
    if tail.startswith("engine/"):
        message = f"Route /{tail} not found"
        return _engine_reply({"error": "Route not found", "message": message}, status=404)
    return plain_text_reply(404, "Route not found")


def _dynamo_unauthorized() -> web.Response:
    return web.json_response(UNAUTHORIZED, status=401)


#: (method, path under the worker, operation for injected latency, handler).
_DYNAMO_ROUTES = (
    ("GET", "/health", "health", _health),
    ("POST", "/v1/loras", "load", _load),
    ("GET", "/v1/loras", "list", _list),
    ("DELETE", "/v1/loras/{lora_name:.*}", "unload", _unload),
    ("POST", "/engine/pause_generation", "pause", _pause),
    ("POST", "/engine/resume_generation", "resume", _resume),
)


_KeyFor = Callable[[str, str, SimWorker, str | None], str | None]


def _dynamo_key_for(method: str, path: str, worker: SimWorker, api_key: str | None) -> str | None:
    return api_key


@dataclass(frozen=True)
class Personality:
    """How one engine kind serves a worker: its routes, the key each route asks
    for (``key_for(method, path, worker, api_key)``, None: none), and its 401
    and 404 answers."""

    routes: Sequence[tuple[str, str, str | None, _Handler]]
    key_for: _KeyFor
    unauthorized: Callable[[], web.Response]
    not_found: _Handler


PERSONALITIES = {
    "dynamo": Personality(_DYNAMO_ROUTES, _dynamo_key_for, _dynamo_unauthorized, _route_not_found),
    "vllm": Personality(
        vllm_routes.ROUTES, vllm_routes.key_for, vllm_routes.unauthorized, vllm_routes.not_found
    ),
    "sglang": Personality(
        sglang_routes.ROUTES,
        sglang_routes.key_for,
        sglang_routes.unauthorized,
        sglang_routes.not_found,
    ),
}
