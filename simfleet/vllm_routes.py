"""The vLLM personality of a simulated worker: its LoRA, model-list, pause and
completion routes.

Paths, status codes, content types and bodies follow a real vLLM 0.32.0
(``tests/real_vllm/test_vllm_vs_sim.py`` sends both the same requests) and the
source of vLLM 0.33.0 (``vllm/entrypoints/serve/lora/api_router.py``,
``vllm/entrypoints/openai/models/serving.py``,
``vllm/entrypoints/rl/online/api_router.py``, the validation and auth
middleware), as a server runs with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
and ``VLLM_SERVER_DEV_MODE=1``:

- A load or unload that succeeds answers 200 with **plain text**; vLLM sends
  it with no ``Content-Type``, the sim with ``application/octet-stream``
  (aiohttp adds that to any body without one).
- Errors are ``{"error": {"message", "type", "param", "code"}}``: 404
  ``NotFoundError`` for a directory without an adapter ("Loading lora <name>
  failed: No adapter found for <path>", with that literal ``<path>``) and for
  an unload of an unknown name, 400 ``InvalidUserInput`` for a name already
  loaded, 400 ``Bad Request`` with pydantic's error and the field as
  ``param`` for a body or query that does not validate or is not
  ``application/json``, 500
  ``InternalServerError`` for the engine's other failures.
- ``POST /pause?mode=abort|wait|keep`` (vLLM's default: abort) answers
  ``{"status": "paused"}``, ``/resume`` ``{"status": "resumed"}``,
  ``GET /is_paused`` ``{"is_paused": bool}``.
- ``POST /v1/completions {"model", "prompt", "max_tokens", "temperature"}``
  for the base model or an adapter the worker holds answers an OpenAI
  ``text_completion`` of one token (:mod:`.generation`); ``model`` left out
  means the base model. Any other name, or one made unroutable, is a 404
  ``NotFoundError`` "The model `<name>` does not exist." with ``param``
  ``"model"``, answered at once, as vLLM checks the name before its engine
  sees the request; a known one waits while the engine is paused, as vLLM's
  engine holds new requests until it resumes.
- ``POST /reset_prefix_cache`` answers ``{"success": true}`` and counts the
  reset on the worker (``SimWorker.cache_resets``).
- Only ``/v1/...`` paths need the API key (401 ``{"error": "Unauthorized"}``);
  an unknown path is FastAPI's 404 ``{"detail": "Not Found"}``, and a served
  path asked with another method its 405 ``{"detail": "Method Not Allowed"}``
  (Starlette answers both from its route table).

A worker's :class:`~.state.EngineSetup` says how vLLM was started: without
``lora_updating`` (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) it serves neither
LoRA route, without ``dev_mode`` (``VLLM_SERVER_DEV_MODE``) none of
``/pause``, ``/resume``, ``/is_paused``, ``/reset_prefix_cache``: each is
then an unknown path
(``vllm/entrypoints/serve/lora/api_router.py``,
``vllm/entrypoints/launchers/api_server/routers.py``). With ``dev_mode`` it
also serves ``GET /get_world_size?include_dp=`` (``{"world_size"}``: TP*PP,
times the DP size unless ``include_dp=false``) and ``GET
/server_info?config_format=text|json`` (``{"vllm_config", "vllm_env",
"system_env"}``, the config a string, or with ``json`` an object whose
``parallel_config`` the sim fills in).

Data parallelism (``EngineSetup.data_parallel_size`` N and
``api_server_count`` K, as vLLM 0.32 runs ``--data-parallel-size`` with
internal load balancing): each of the K API servers keeps its own LoRA
registry, and each request (load, unload, model list, completion) is answered
by the next one in turn. A load registers the name in the registry of the API
server that answered it only, and reaches every DP rank's engine but those in
``WorkerFaults.load_misses_ranks``; an unload unregisters it from its API
server, and every rank drops it. The model list is the answering API server's
registry; a completion for a name it does not know is the 404 above. A
completion runs on the DP rank its ``X-data-parallel-rank`` header names (a
header that is not an integer is ignored, one out of range is a 400
``BadRequestError`` "data_parallel_rank r is out of range [0, N).", vLLM's
``VLLMValidationError``), else on each rank in turn; a rank that does not hold
the adapter answers the 404 too, and the reply names the rank. Real vLLM
would load an adapter missing on a rank from its path on first use; the sim
fails it, so that a test sees a load that did not reach every rank.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from .generation import generates_on_rank, text_completion
from .http_utils import error_reply, models_reply
from .lora_source import NotAnAdapter, check_local_adapter
from .state import SimWorker

__all__ = ["ROUTES", "is_guarded", "key_for", "not_found", "unauthorized"]

_Handler = Callable[[web.Request, SimWorker, bytes], Awaitable[web.Response]]
_PAUSE_MODES = ("abort", "wait", "keep")
#: vLLM's AuthenticationMiddleware guards only these prefixes.
_GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
#: vLLM's ``max_tokens`` when a completion asks none.
_DEFAULT_MAX_TOKENS = 16
#: The header that places a completion on one DP rank.
_DP_RANK_HEADER = "X-data-parallel-rank"
#: What FastAPI reads as a boolean query parameter (pydantic's lax bool).
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _error(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.json_response(body, status=status)


def _invalid(error: dict[str, Any] | str) -> web.Response:
    """vLLM's answer to a request that fails validation: pydantic's error, as
    its exception handler words it, with the failing field as ``param``."""
    loc = error.get("loc") if isinstance(error, dict) else None
    return _error(400, f"1 validation error:\n  {error}", "Bad Request", loc)


def _text(text: str) -> web.Response:
    # vLLM sends none; aiohttp sends application/octet-stream for a body
    # without one, which the driver treats alike: not JSON.
    return web.Response(body=text.encode())


def _json_body(request: web.Request, raw: bytes, *fields: str) -> dict[str, Any] | web.Response:
    """The body of a LoRA route, checked as vLLM's ``validate_json_request`` and
    its pydantic model do (each failure a 400)."""
    if request.content_type != "application/json":
        return _invalid("Unsupported Media Type: Only 'application/json' is allowed")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        return _invalid(
            {"type": "json_invalid", "loc": f"body.{exc.pos}", "msg": "JSON decode error",
             "input": "<dict of 0 items>", "ctx": {"error": exc.msg}}
        )  # fmt: skip
    if not isinstance(body, dict):
        return _invalid(
            {"type": "model_attributes_type", "loc": "body",
             "msg": "Input should be a valid dictionary or object to extract fields from",
             "input": body}
        )  # fmt: skip
    for name in fields:
        if not isinstance(body.get(name), str):
            return _invalid(
                {"type": "missing", "loc": f"body.{name}", "msg": "Field required",
                 "input": f"<dict of {len(body)} items>"}
            )  # fmt: skip
    return body


def is_guarded(path: str) -> bool:
    """Whether vLLM asks for the API key on ``path`` (relative to the server)."""
    return path.startswith(_GUARDED_PREFIX)


def key_for(method: str, path: str, worker: SimWorker, api_key: str | None) -> str | None:
    """The key vLLM asks for on ``path`` (None: none)."""
    return api_key if is_guarded(path) else None


def unauthorized() -> web.Response:
    return web.json_response({"error": "Unauthorized"}, status=401)


#: The routes vLLM mounts only when started with a flag, and that flag's field
#: of :class:`~.state.EngineSetup`.
_MOUNTED_WITH = {
    "/v1/load_lora_adapter": "lora_updating",
    "/v1/unload_lora_adapter": "lora_updating",
    "/pause": "dev_mode",
    "/resume": "dev_mode",
    "/is_paused": "dev_mode",
    "/reset_prefix_cache": "dev_mode",
    "/get_world_size": "dev_mode",
    "/server_info": "dev_mode",
}


def _mounted(worker: SimWorker, path: str) -> bool:
    flag = _MOUNTED_WITH.get(path)
    return flag is None or bool(getattr(worker.setup, flag))


async def not_found(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    path = request.path.removeprefix(f"/workers/{worker.worker_id}")
    allowed = [m for m, p, _, _ in ROUTES if p == path and _mounted(worker, p)]
    if allowed and request.method not in allowed:
        headers = {"Allow": ", ".join(allowed)}
        return web.json_response({"detail": "Method Not Allowed"}, status=405, headers=headers)
    return web.json_response({"detail": "Not Found"}, status=404)


def _if_mounted(handler: _Handler) -> _Handler:
    """``handler``, on a worker whose vLLM was started with the route's flag."""

    async def handle(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
        path = request.path.removeprefix(f"/workers/{worker.worker_id}")
        if not _mounted(worker, path):
            return await not_found(request, worker, raw)
        return await handler(request, worker, raw)

    return handle


async def _load(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    api_server = worker.take_api_server()
    body = _json_body(request, raw, "lora_name", "lora_path")
    if isinstance(body, web.Response):
        return body
    name, path = body["lora_name"], body["lora_path"]
    if not name or not path:
        return _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    if name == worker.base_model:
        message = f"The lora adapter '{name}' conflicts with a served base model."
        return _error(400, message, "InvalidUserInput")
    if worker.registered_in(name, api_server) and not body.get("load_inplace"):
        message = (
            f"The lora adapter '{name}' has already been loaded. If you want to load "
            "the adapter in place, set 'load_inplace' to True."
        )
        return _error(400, message, "InvalidUserInput")
    try:
        # vLLM reads a local directory, else tries the hub; a path that is
        # neither, or a directory without the adapter files, is "not found".
        check_local_adapter(path)
    except NotAnAdapter:
        # vLLM puts the literal "<path>" in place of the path.
        message = f"Loading lora {name} failed: No adapter found for <path>"
        return _error(404, message, "NotFoundError")
    if worker.take_injected_load_failure():
        status = worker.faults.load_failure_status
        err_type = "InternalServerError" if status >= 500 else "BadRequestError"
        return _error(status, f"injected load failure of {name}", err_type)
    worker.add_adapter(
        name, path, api_server=api_server, missing_ranks=worker.faults.load_misses_ranks
    )
    return _text(f"Success: LoRA adapter '{name}' added successfully.")


async def _unload(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    api_server = worker.take_api_server()
    body = _json_body(request, raw, "lora_name")
    if isinstance(body, web.Response):
        return body
    name = body["lora_name"]
    if not name:
        message = "'lora_name' needs to be provided to unload a LoRA adapter."
        return _error(400, message, "InvalidUserInput")
    if not worker.registered_in(name, api_server):
        return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
    if worker.take_injected_unload_failure():
        return _error(500, f"injected unload failure of {name}", "InternalServerError")
    worker.remove_adapter(name, api_server=api_server)
    return _text(f"Success: LoRA adapter '{name}' removed successfully.")


async def _models(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    registry = worker.registry(worker.take_api_server())
    permission = [{"object": "model_permission", "allow_sampling": True, "allow_view": True}]
    return models_reply(worker, owned_by="vllm", adapters=registry, permission=permission)


async def _pause(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    mode = request.query.get("mode", "abort")
    if mode not in _PAUSE_MODES:
        expected = "'abort', 'wait' or 'keep'"
        return _invalid(
            {"type": "literal_error", "loc": "query.mode", "msg": f"Input should be {expected}",
             "input": mode, "ctx": {"expected": expected}}
        )  # fmt: skip
    if mode != "keep" and worker.faults.busy_loras:
        worker.set_faults(busy_loras=[])  # waited for or aborted
    worker.paused = True
    return web.json_response({"status": "paused"})


async def _resume(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    worker.paused = False
    return web.json_response({"status": "resumed"})


async def _is_paused(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    return web.json_response({"is_paused": worker.paused})


async def _completions(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    api_server = worker.take_api_server()
    body = _json_body(request, raw, "prompt")
    if isinstance(body, web.Response):
        return body
    model = body.get("model", worker.base_model)
    if not isinstance(model, str):
        return _invalid(
            {"type": "string_type", "loc": "body.model", "msg": "Input should be a valid string",
             "input": model}
        )  # fmt: skip
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = _DEFAULT_MAX_TOKENS
    elif type(max_tokens) is not int:
        return _invalid(
            {"type": "int_type", "loc": "body.max_tokens",
             "msg": "Input should be a valid integer", "input": max_tokens}
        )  # fmt: skip
    if model != worker.base_model and not worker.registered_in(model, api_server):
        return _unknown_model(model)
    rank = _requested_rank(request)
    size = worker.setup.data_parallel_size
    if rank is None:
        rank = worker.take_dp_rank()
    elif not 0 <= rank < size:
        return _error(
            400, f"data_parallel_rank {rank} is out of range [0, {size}).", "BadRequestError"
        )
    if not generates_on_rank(worker, model, rank):
        return _unknown_model(model)
    if not await worker.wait_resumed():
        return error_reply(503, "simulated fleet is stopping")
    return web.json_response(text_completion(worker, model, body["prompt"], max_tokens, rank))


def _unknown_model(model: str) -> web.Response:
    return _error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def _requested_rank(request: web.Request) -> int | None:
    """The DP rank a completion's header asks for; None when it asks none or
    names no integer (vLLM's ``_get_data_parallel_rank`` ignores those)."""
    value = request.headers.get(_DP_RANK_HEADER)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


async def _get_world_size(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    value = request.query.get("include_dp", "true")
    if value.lower() not in _TRUE | _FALSE:
        return _invalid(
            {"type": "bool_parsing", "loc": "query.include_dp",
             "msg": "Input should be a valid boolean, unable to interpret input", "input": value}
        )  # fmt: skip
    world_size = worker.world_size
    if value.lower() in _TRUE:
        world_size *= worker.setup.data_parallel_size
    return web.json_response({"world_size": world_size})


async def _server_info(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    config_format = request.query.get("config_format", "text")
    if config_format not in ("text", "json"):
        expected = "'text' or 'json'"
        return _invalid(
            {"type": "literal_error", "loc": "query.config_format",
             "msg": f"Input should be {expected}", "input": config_format,
             "ctx": {"expected": expected}}
        )  # fmt: skip
    # The sim knows one rank's world size (TP*PP), and calls it all TP.
    size = worker.setup.data_parallel_size
    config: str | dict[str, Any]
    if config_format == "text":
        config = (
            f"model={worker.base_model!r}, tensor_parallel_size={worker.world_size}, "
            f"pipeline_parallel_size=1, data_parallel_size={size}"
        )
    else:
        parallel = {
            "pipeline_parallel_size": 1,
            "tensor_parallel_size": worker.world_size,
            "data_parallel_size": size,
            "data_parallel_size_local": size,
            "data_parallel_rank": 0,
            "data_parallel_rank_local": None,
            "data_parallel_backend": "mp",
            "data_parallel_external_lb": False,
            "data_parallel_hybrid_lb": False,
            "world_size": worker.world_size,
            "rank": 0,
            "_api_process_count": worker.setup.api_server_count,
            "_api_process_rank": 0,
        }
        model = {"model": worker.base_model, "max_model_len": 4096}
        config = {"model_config": model, "parallel_config": parallel}
    return web.json_response({"vllm_config": config, "vllm_env": {}, "system_env": {}})


async def _reset_prefix_cache(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    worker.reset_cache()
    return web.json_response({"success": True})


async def _health(request: web.Request, worker: SimWorker, raw: bytes) -> web.Response:
    return web.Response(status=200)


#: (method, path under the worker, operation for injected latency, handler).
ROUTES = (
    ("POST", "/v1/load_lora_adapter", "load", _if_mounted(_load)),
    ("POST", "/v1/unload_lora_adapter", "unload", _if_mounted(_unload)),
    ("GET", "/v1/models", "list", _models),
    ("POST", "/pause", "pause", _if_mounted(_pause)),
    ("POST", "/resume", "resume", _if_mounted(_resume)),
    ("GET", "/is_paused", None, _if_mounted(_is_paused)),
    ("POST", "/v1/completions", None, _completions),
    ("POST", "/reset_prefix_cache", None, _if_mounted(_reset_prefix_cache)),
    ("GET", "/get_world_size", None, _if_mounted(_get_world_size)),
    ("GET", "/server_info", None, _if_mounted(_server_info)),
    ("GET", "/health", "health", _health),
)
