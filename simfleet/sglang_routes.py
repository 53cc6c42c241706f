"""The SGLang personality of a simulated worker: its LoRA, model-list and pause routes.

Paths, status codes and bodies follow the source of SGLang 0.5.23
(``python/sglang/srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``,
``srt/managers/tokenizer_control_mixin.py``, ``srt/lora/lora_manager.py``,
``srt/lora/lora_registry.py``, ``srt/utils/auth.py``), as a server runs with
``--enable-lora``:

- ``/load_lora_adapter`` and ``/unload_lora_adapter`` answer JSON
  ``{"rid": null, "http_worker_ipc": null, "success", "error_message",
  "loaded_adapters"}``: 200 when it worked, **400 for every failure** (an
  adapter already loaded, an unknown name, a directory without an adapter).
  ``loaded_adapters`` maps name to path (null in an unload's refusal).
- A body that does not validate is a 400 in SGLang's legacy error shape
  ``{"object": "error", "message", "type": "Bad Request", "param", "code"}``.
- ``POST /pause_generation {"mode": "abort"|"retract"|"in_place"}`` and
  ``POST /continue_generation`` answer ``{"message": ..., "status": "ok"}``.
- ``GET /v1/models`` lists the served model and each adapter with ``root``
  (its path) and ``parent``.
- With an API key every route but ``/health`` needs it (401 ``{"error":
  "Unauthorized"}``); an unknown path is FastAPI's 404 ``{"detail": "Not Found"}``.

The words of a load of a directory without ``adapter_config.json`` are
PEFT's ("Can't find 'adapter_config.json' at '<path>'"); the real message
depends on the PEFT and hub versions installed beside SGLang, and agents do
not match on it (every SGLang refusal is final).
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from .lora_source import NotAnAdapter, check_local_adapter
from .state import SimWorker

__all__ = ["ROUTES", "is_guarded", "not_found", "unauthorized"]

_PAUSE_MODES = ("abort", "retract", "in_place")
_CREATED = int(time.time())


def _bad_request(message: str) -> web.Response:
    body = {
        "object": "error",
        "message": message,
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }
    return web.json_response(body, status=400)


def _update(
    success: bool,
    worker: SimWorker,
    error_message: str = "",
    *,
    status: int | None = None,
    listed: bool = True,
) -> web.Response:
    """A ``LoRAUpdateOutput``: 200 on success, else 400 (or an injected status)."""
    body = {
        "rid": None,
        "http_worker_ipc": None,
        "success": success,
        "error_message": error_message,
        "loaded_adapters": dict(worker.adapter_paths) if listed else None,
    }
    return web.json_response(body, status=status or (200 if success else 400))


def _json_body(raw: bytes, *fields: str) -> dict[str, Any] | web.Response:
    try:
        body = json.loads(raw) if raw.strip() else None
    except ValueError as exc:
        return _bad_request(f"JSON decode error: {exc}")
    if not isinstance(body, dict):
        return _bad_request("Field required: body")
    for name in fields:
        if not isinstance(body.get(name), str):
            return _bad_request(f"Object missing required field `{name}`")
    return body


def is_guarded(path: str) -> bool:
    """Whether SGLang asks for the API key on ``path`` (every route but /health)."""
    return path != "/health"


def unauthorized() -> web.Response:
    return web.json_response({"error": "Unauthorized"}, status=401)


async def not_found(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    return web.json_response({"detail": "Not Found"}, status=404)


async def _load(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    body = _json_body(raw, "lora_name", "lora_path")
    if isinstance(body, web.Response):
        return body
    name, path = body["lora_name"], body["lora_path"]
    if name in worker.adapters:
        message = f"Failed to load LoRA adapter {name} because it is already loaded"
        return _update(False, worker, message)
    try:
        check_local_adapter(path)
    except NotAnAdapter:
        return _update(False, worker, f"Can't find 'adapter_config.json' at '{path}'")
    if worker.take_injected_load_failure():
        message = f"injected load failure of {name}"
        return _update(False, worker, message, status=worker.faults.load_failure_status)
    worker.add_adapter(name, path)
    return _update(True, worker)


async def _unload(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    body = _json_body(raw, "lora_name")
    if isinstance(body, web.Response):
        return body
    name = body["lora_name"]
    if name not in worker.adapters:
        loaded = f"dict_keys({list(worker.adapters)!r})"
        message = f"LoRA with name {name} does not exist. Loaded LoRAs: {loaded}"
        return _update(False, worker, message, listed=False)
    if worker.take_injected_unload_failure():
        return _update(False, worker, f"injected unload failure of {name}", status=500)
    worker.remove_adapter(name)
    return _update(True, worker)


def _card(
    model_id: str, root: str, parent: str | None, max_model_len: int | None
) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": _CREATED,
        "owned_by": "sglang",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
    }


async def _models(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    base = worker.base_model
    data = [_card(base, base, None, 4096)]
    data += [_card(n, worker.adapter_paths.get(n, ""), base, None) for n in worker.adapters]
    return web.json_response({"object": "list", "data": data})


async def _pause(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    body = _json_body(raw)
    if isinstance(body, web.Response):
        return body
    mode = body.get("mode", "abort")
    if mode not in _PAUSE_MODES:
        return _bad_request(f"Invalid enum value {mode!r} - at `$.mode`")
    if mode != "in_place" and worker.faults.busy_loras:
        worker.set_faults(busy_loras=[])  # aborted or retracted
    worker.paused = True
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def _continue(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    body = _json_body(raw)
    if isinstance(body, web.Response):
        return body
    worker.paused = False
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def _health(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    return web.Response(status=200)


#: (method, path under the worker, operation for injected latency, handler).
ROUTES = (
    ("POST", "/load_lora_adapter", "load", _load),
    ("POST", "/unload_lora_adapter", "unload", _unload),
    ("GET", "/v1/models", "list", _models),
    ("POST", "/pause_generation", "pause", _pause),
    ("POST", "/continue_generation", "resume", _continue),
    ("GET", "/health", "health", _health),
)
