"""The system status server of each simulated worker, under ``/workers/{id}``.

One aiohttp route table serves every worker: the worker id is a path segment,
so a thousand workers share one port. Paths, payloads, status codes and
messages follow a real Dynamo 1.6 worker (see docs ENGINES.md), including its
quirks: a malformed load body gets a plain-text 422, a failed load a JSON 500
(or, with ``status_error_quirk``, a 200 whose body says ``"status":"error"``).

Every request is first recorded in the worker's log, then waits out an
injected ``hang`` and latency, then is checked for the bearer token, then
handled.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Literal

import msgspec
from aiohttp import web

from .http_utils import UNAUTHORIZED, error_reply, is_authorized, json_or_none, plain_text_reply
from .lora_source import LoraSourceError, check_adapter_dir, local_path_of
from .state import RecordedRequest, SimWorker

__all__ = ["WORKER_PREFIX", "WorkerRoutes"]

WORKER_PREFIX = "/workers/{worker_id}"

_Handler = Callable[[web.Request, SimWorker, bytes], Awaitable[web.Response]]
_Route = Callable[[web.Request], Awaitable[web.Response]]


class _LoraSource(msgspec.Struct):
    uri: str


class _LoadLora(msgspec.Struct):
    lora_name: str
    source: _LoraSource


class _Pause(msgspec.Struct):
    mode: Literal["keep", "wait", "abort"] = "keep"
    clear_cache: bool = False


_LOAD_DECODER = msgspec.json.Decoder(_LoadLora)
_PAUSE_DECODER = msgspec.json.Decoder(_Pause)
_BAD_BODY = (msgspec.DecodeError, msgspec.ValidationError)
_OK = {"status": "ok"}


def _deserialization_error(exc: Exception) -> web.Response:
    # The real runtime (axum) answers a bad body with plain text, not JSON.
    return plain_text_reply(422, f"Failed to deserialize the JSON body into the target type: {exc}")


def _lora_success(name: str, lora_id: int, message: str) -> web.Response:
    body = {"status": "success", "message": message, "lora_name": name, "lora_id": lora_id}
    return web.json_response(body)


def _load_error(worker: SimWorker, name: str, message: str) -> web.Response:
    status = 200 if worker.faults.status_error_quirk else 500
    body = {"status": "error", "message": message, "lora_name": name}
    return web.json_response(body, status=status)


class WorkerRoutes:
    """Route table of all workers' system servers."""

    def __init__(self, workers: Mapping[str, SimWorker], *, api_key: str | None):
        self._workers = workers
        self._api_key = api_key

    def routes(self) -> list[web.RouteDef]:
        p = WORKER_PREFIX
        return [
            web.get(f"{p}/health", self._operation("health", _health)),
            web.post(f"{p}/v1/loras", self._operation("load", _load)),
            web.get(f"{p}/v1/loras", self._operation("list", _list)),
            web.delete(f"{p}/v1/loras/{{lora_name:.*}}", self._operation("unload", _unload)),
            web.post(f"{p}/engine/pause_generation", self._operation("pause", _pause)),
            web.post(f"{p}/engine/resume_generation", self._operation("resume", _resume)),
            # Registered last: anything else under a worker, e.g. /engine/<unknown>.
            web.route("*", f"{p}/{{tail:.*}}", self._operation(None, _route_not_found)),
        ]

    def _operation(self, op: str | None, handler: _Handler) -> _Route:
        async def handle(request: web.Request) -> web.Response:
            worker_id = request.match_info["worker_id"]
            worker = self._workers.get(worker_id)
            if worker is None:
                return error_reply(404, "unknown worker")
            raw = await request.read()
            worker.record(
                RecordedRequest(
                    method=request.method,
                    path=request.path.removeprefix(f"/workers/{worker_id}"),
                    headers={name.lower(): value for name, value in request.headers.items()},
                    body=json_or_none(raw),
                    ts=time.time(),
                )
            )
            if not await worker.wait_until(lambda: not worker.faults.hang):
                return error_reply(503, "simulated fleet is stopping")
            if op is not None:
                await worker.delay(worker.faults.latency_s.get(op, 0.0))
            if worker.released:
                return error_reply(503, "simulated fleet is stopping")
            if not is_authorized(request, self._api_key):
                return web.json_response(UNAUTHORIZED, status=401)
            return await handler(request, worker, raw)

        return handle


async def _health(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    return web.json_response({"status": "ready"})


async def _load(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    try:
        load = _LOAD_DECODER.decode(raw)
    except _BAD_BODY as exc:
        return _deserialization_error(exc)
    name = load.lora_name
    try:
        path = local_path_of(load.source.uri)
    except LoraSourceError as exc:
        return _load_error(worker, name, str(exc))
    if name in worker.adapters:
        # Like Dynamo without hot-swap: the path is not looked at again.
        return _lora_success(name, worker.adapters[name], f"LoRA adapter '{name}' already loaded")
    try:
        check_adapter_dir(path)
    except LoraSourceError as exc:
        return _load_error(worker, name, str(exc))
    if worker.take_injected_load_failure():
        return _load_error(worker, name, "injected load failure")
    lora_id = worker.add_adapter(name)
    return _lora_success(name, lora_id, f"LoRA adapter '{name}' loaded successfully")


async def _list(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    loras = dict(worker.adapters)
    return web.json_response({"status": "success", "loras": loras, "count": len(loras)})


async def _unload(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    name = request.match_info["lora_name"]
    lora_id = worker.remove_adapter(name)
    if lora_id is None:
        # json.dumps renders the list like the runtime's Rust debug format.
        available = json.dumps(sorted(worker.adapters))
        message = f"LoRA adapter '{name}' not found. Available LoRAs: {available}"
        return web.json_response({"status": "error", "message": message}, status=500)
    return _lora_success(name, lora_id, f"LoRA adapter '{name}' unloaded successfully")


async def _pause(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    if raw.strip():
        try:
            _PAUSE_DECODER.decode(raw)
        except _BAD_BODY as exc:
            return _deserialization_error(exc)
    worker.paused = True
    return web.json_response(_OK)


async def _resume(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    worker.paused = False
    return web.json_response(_OK)


async def _route_not_found(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    return error_reply(404, "Route not found")
