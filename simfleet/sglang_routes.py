"""The SGLang personality of a simulated worker: its LoRA, model-list, pause and
generate routes.

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
- ``POST /generate {"text", "lora_path", "sampling_params": {"max_new_tokens",
  "temperature"}}`` answers ``{"text", "meta_info": {"id", "finish_reason",
  "prompt_tokens", "completion_tokens"}}`` for one token (:mod:`.generation`);
  without ``lora_path`` the base model answers. It first waits while
  generation is paused (the tokenizer manager's pause gate comes before its
  LoRA lookup), then a ``lora_path`` the worker does not hold, or one made
  unroutable, is a 400 ``{"error": {"message": "The following requested LoRA
  adapters are not loaded: <name>"}}`` and a second line listing the loaded
  ones (``LoRARegistry``'s ValueError, as ``http_server.generate_request``
  answers it).
- ``POST /flush_cache`` (and ``GET``) answers SGLang's plain text "Cache
  flushed. ..." and counts the flush on the worker (``SimWorker.cache_resets``).
- ``GET /v1/models`` lists the served model and each adapter with ``root``
  (its path) and ``parent``.
- ``GET /server_info`` (and the older ``/get_server_info``) lists the
  resolved server arguments; the sim answers those an agent reads
  (``dp_size``, ``enable_lora``, ``max_loaded_loras``, ...) and ``version``.
- Keys (``srt/utils/auth.py``): the LoRA, pause and continue routes take the
  worker's admin key when it has one (``EngineSetup.admin_api_key``, SGLang's
  ``--admin-api-key``), else the fleet's API key; so does ``/flush_cache``;
  every other route (``/generate`` too) but
  ``/health`` takes the API key only. A refusal is 401 ``{"error":
  "Unauthorized"}``; an unknown path is FastAPI's 404 ``{"detail": "Not Found"}``.
- With ``EngineSetup.dp_size`` above 1 a load or unload that validates fails
  on SGLang's assert, which no handler catches: Starlette's plain-text 500
  ``Internal Server Error``.
- With ``EngineSetup.max_loaded_loras`` a load that makes one adapter too
  many succeeds after unloading the least recently used others (SGLang's
  ``load_lora_adapter`` in ``tokenizer_control_mixin.py``, with
  ``LoRARegistry.lru_lora_name``): ``loaded_adapters`` no longer lists them.
  SGLang counts a request for an adapter as a use; the sim counts loads only,
  so its least recently used adapter is the one loaded first.
- An unload waits for the requests running on its adapter
  (``WorkerFaults.busy_loras``), holding SGLang's LoRA update lock
  (``LoRARegistry.unregister`` waits for the adapter's counter to reach
  zero): while an ``in_place`` pause freezes them, it waits until the
  engine continues, then they finish and the unload answers.

The words of a load of a directory without ``adapter_config.json`` are
PEFT's ("Can't find 'adapter_config.json' at '<path>'"); the real message
depends on the PEFT and hub versions installed beside SGLang, and agents do
not match on it (every SGLang refusal is final).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from .generation import generates, prompt_tokens, reply_text
from .http_utils import error_reply, models_reply
from .lora_source import NotAnAdapter, check_local_adapter
from .state import SimWorker

__all__ = ["ROUTES", "is_guarded", "key_for", "not_found", "unauthorized"]

_PAUSE_MODES = ("abort", "retract", "in_place")
#: The routes SGLang marks ``ADMIN_OPTIONAL`` among those the sim serves.
_ADMIN_ROUTES = frozenset(
    {
        ("POST", "/load_lora_adapter"),
        ("POST", "/unload_lora_adapter"),
        ("POST", "/pause_generation"),
        ("POST", "/continue_generation"),
        ("GET", "/flush_cache"),
        ("POST", "/flush_cache"),
    }
)
_OPEN_PREFIXES = ("/health", "/ready", "/metrics")
#: SGLang's ``max_new_tokens`` when a request asks none.
_DEFAULT_MAX_NEW_TOKENS = 128
_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


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
    """Whether SGLang asks for a key on ``path`` when it has one (every route
    but its health, readiness and metrics ones)."""
    return not path.startswith(_OPEN_PREFIXES)


def key_for(method: str, path: str, worker: SimWorker, api_key: str | None) -> str | None:
    """The key SGLang asks for on ``method path`` (None: none), as its
    ``decide_request_auth`` does for the levels of the routes the sim serves."""
    if not is_guarded(path):
        return None
    if (method, path) in _ADMIN_ROUTES:
        return worker.setup.admin_api_key or api_key
    return api_key


def _server_error() -> web.Response:
    """Starlette's answer when a handler raises what nothing catches."""
    return web.Response(status=500, text="Internal Server Error", content_type="text/plain")


def unauthorized() -> web.Response:
    return web.json_response({"error": "Unauthorized"}, status=401)


async def not_found(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    return web.json_response({"detail": "Not Found"}, status=404)


async def _load(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    body = _json_body(raw, "lora_name", "lora_path")
    if isinstance(body, web.Response):
        return body
    name, path = body["lora_name"], body["lora_path"]
    if worker.setup.dp_size > 1:
        return _server_error()  # "data-parallel replicas are not supported ..."
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
    limit = worker.setup.max_loaded_loras
    while limit is not None and len(worker.adapters) > limit:
        worker.remove_adapter(next(iter(worker.adapters)))  # never the one just loaded
    return _update(True, worker)


async def _unload(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    body = _json_body(raw, "lora_name")
    if isinstance(body, web.Response):
        return body
    name = body["lora_name"]
    if worker.setup.dp_size > 1:
        return _server_error()
    if name not in worker.adapters:
        loaded = f"dict_keys({list(worker.adapters)!r})"
        message = f"LoRA with name {name} does not exist. Loaded LoRAs: {loaded}"
        return _update(False, worker, message, listed=False)
    if worker.take_injected_unload_failure():
        return _update(False, worker, f"injected unload failure of {name}", status=500)
    if name in worker.faults.busy_loras:
        # Frozen by an in_place pause, they finish only once generation continues.
        if not await worker.wait_until(lambda: not worker.paused):
            return _server_error()  # the fleet stopped
        worker.set_faults(busy_loras=[n for n in worker.faults.busy_loras if n != name])
    worker.remove_adapter(name)
    return _update(True, worker)


async def _models(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    return models_reply(worker, owned_by="sglang")


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


async def _generate(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    body = _json_body(raw, "text")
    if isinstance(body, web.Response):
        return body
    lora_path, sampling = body.get("lora_path"), body.get("sampling_params") or {}
    if lora_path is not None and not isinstance(lora_path, str):
        return _bad_request("Invalid type for `lora_path` - at `$.lora_path`")
    if not isinstance(sampling, dict):
        return _bad_request("Expected `object` - at `$.sampling_params`")
    max_new_tokens = sampling.get("max_new_tokens", _DEFAULT_MAX_NEW_TOKENS)
    if not await worker.wait_resumed():
        return error_reply(503, "simulated fleet is stopping")
    model = lora_path or worker.base_model
    if lora_path and (lora_path == worker.base_model or not generates(worker, lora_path)):
        known = [name for name in worker.adapters if generates(worker, name)]
        message = (
            f"The following requested LoRA adapters are not loaded: {lora_path}\n"
            f"Loaded adapters: odict_keys({known!r})."
        )
        return web.json_response({"error": {"message": message}}, status=400)
    if max_new_tokens == 1:
        finish_reason: dict[str, Any] = {"type": "length", "length": 1}
    else:
        finish_reason = {"type": "stop", "matched": None}
    meta_info = {
        "id": uuid.uuid4().hex,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens(body["text"]),
        "completion_tokens": 1,
    }
    return web.json_response({"text": reply_text(worker, model), "meta_info": meta_info})


async def _flush_cache(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    worker.reset_cache()
    # SGLang sends no Content-Type; aiohttp adds application/octet-stream.
    return web.Response(body=_FLUSHED.encode())


async def _server_info(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    info = {
        "model_path": worker.base_model,
        "served_model_name": worker.base_model,
        "tp_size": worker.world_size,
        "dp_size": worker.setup.dp_size,
        "enable_lora": True,
        "max_loaded_loras": worker.setup.max_loaded_loras,
        "max_loras_per_batch": 8,
        "version": "0.5.23",
    }
    if not worker.setup.shows_max_loaded_loras:
        del info["max_loaded_loras"]
    return web.json_response(info)


async def _health(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    return web.Response(status=200)


#: (method, path under the worker, operation for injected latency, handler).
ROUTES = (
    ("POST", "/load_lora_adapter", "load", _load),
    ("POST", "/unload_lora_adapter", "unload", _unload),
    ("GET", "/v1/models", "list", _models),
    ("POST", "/pause_generation", "pause", _pause),
    ("POST", "/continue_generation", "resume", _continue),
    ("POST", "/generate", None, _generate),
    ("GET", "/flush_cache", None, _flush_cache),
    ("POST", "/flush_cache", None, _flush_cache),
    ("GET", "/server_info", None, _server_info),
    ("GET", "/get_server_info", None, _server_info),
    ("GET", "/health", "health", _health),
)
