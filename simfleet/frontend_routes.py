"""The simulated Dynamo frontend: model list, RL discovery, chat and completions.

It sits at the root of the fleet's server. Like the real frontend it lists the
base model plus the union of adapters any worker holds (listing proves nothing
about every replica), and routes a chat or completion request only among the
workers that hold the requested model, round-robin — the strict routing
lorabus tells operators to configure — or to exactly the worker its ``nvext``
names (``backend_instance_id`` or ``decode_worker_id``: an agent's canary asks
its own engine). A fleet with prefill workers (``SimWorker.role``) runs each
request disaggregated, on a prefill and a decode worker that both hold the
model (:mod:`.placement` decides, also ``nvext.prefill_worker_id``). A request
that lands on a paused worker is held until that worker resumes, for at most
``paused_wait_s``; one that reaches a worker whose generation does not know
the name (an adapter made unroutable, :mod:`.generation`) is a 404 "Model not
found", as for a name no worker holds. Dynamo's workers serve no generation
route of their own: the frontend records a completion in the log of each
worker it placed it on, as ``POST /v1/completions``.

Shapes follow a real Dynamo 1.6.1 frontend: errors are flat
``{"message", "type", "code"}`` bodies (``{"message": "Model not found",
"type": "Not Found", "code": 404}``), and each ``/v1/rl/workers`` entry
describes the worker's ``rl`` endpoint (``endpoint``, ``transport``,
``request_plane_url``) with a full 64-bit ``instance_id`` and no
``admin_base_url``, under the component its role registers with (``prefill``
for prefill workers, else ``backend``). A completion answers OpenAI's
``text_completion``; when ``nvext.extra_fields`` asks for ``"worker_id"``, the
answer carries ``"nvext": {"worker_id": {"prefill_worker_id",
"decode_worker_id"}}`` (one worker's id twice when aggregated).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from .generation import generates, reply_text, text_completion
from .http_utils import UNAUTHORIZED, is_authorized, recorded
from .placement import Placement, Placer, Refusal, Targets
from .state import SimWorker

__all__ = ["PAUSED_WAIT_S", "RL_ROUTES", "FrontendRoutes"]

#: How long a generation request waits for a paused worker before a 503.
PAUSED_WAIT_S = 30.0

#: System routes every simulated worker advertises in RL discovery.
RL_ROUTES = ("liveness_probe", "load_lora", "pause_generation", "resume_generation", "unload_lora")


#: The component each role registers its endpoints under (Dynamo's default).
_COMPONENTS = {"aggregated": "backend", "decode": "backend", "prefill": "prefill"}


class _NvExt(msgspec.Struct):
    backend_instance_id: int | None = None
    prefill_worker_id: int | None = None
    decode_worker_id: int | None = None
    extra_fields: list[str] | None = None

    def targets(self) -> Targets:
        decode = self.backend_instance_id
        if self.decode_worker_id is not None:
            decode = self.decode_worker_id
        return Targets(prefill=self.prefill_worker_id, decode=decode)


class _ChatRequest(msgspec.Struct):
    model: str
    messages: list[Any]
    nvext: _NvExt | None = None


class _CompletionRequest(msgspec.Struct):
    model: str
    prompt: str
    max_tokens: int = 16
    nvext: _NvExt | None = None


_CHAT_DECODER = msgspec.json.Decoder(_ChatRequest)
_COMPLETION_DECODER = msgspec.json.Decoder(_CompletionRequest)
_Decoded = TypeVar("_Decoded", _ChatRequest, _CompletionRequest)

_Route = Callable[[web.Request], Awaitable[web.Response]]


def _frontend_error(status: int, message: str) -> web.Response:
    """An error the way Dynamo's frontend answers it: flat, not OpenAI's ``{"error": {...}}``."""
    body = {"message": message, "type": HTTPStatus(status).phrase, "code": status}
    return web.json_response(body, status=status)


class FrontendRoutes:
    """Route table of the frontend (``/v1/...`` at the server root)."""

    def __init__(
        self,
        workers: Mapping[str, SimWorker],
        *,
        api_key: str | None,
        base_model: str,
        system_url: Callable[[str], str],
        paused_wait_s: float = PAUSED_WAIT_S,
    ):
        self._workers = workers
        self._api_key = api_key
        self._base_model = base_model
        self._system_url = system_url
        self._placer = Placer(workers, base_model=base_model, paused_wait_s=paused_wait_s)
        self._created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self._authorized(self._models)),
            web.get("/v1/rl/workers", self._authorized(self._rl_workers)),
            web.post("/v1/chat/completions", self._authorized(self._chat)),
            web.post("/v1/completions", self._authorized(self._completions)),
        ]

    def _authorized(self, handler: _Route) -> _Route:
        async def handle(request: web.Request) -> web.Response:
            if not is_authorized(request, self._api_key):
                return web.json_response(UNAUTHORIZED, status=401)
            return await handler(request)

        return handle

    def _model_entry(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self._created, "owned_by": "nvidia"}

    async def _models(self, request: web.Request) -> web.Response:
        adapters = sorted({name for w in self._workers.values() for name in w.adapters})
        data = [self._model_entry(name) for name in [self._base_model, *adapters]]
        return web.json_response({"object": "list", "data": data})

    async def _rl_workers(self, request: web.Request) -> web.Response:
        entries = []
        for worker in self._workers.values():
            url = self._system_url(worker.worker_id)
            component = _COMPONENTS[worker.role]
            tcp = f"{urlsplit(url).netloc}/{worker.instance_id:016x}/dynamo/{component}/rl"
            entries.append(
                {
                    "namespace": "dynamo",
                    "component": component,
                    "endpoint": "rl",
                    "instance_id": worker.instance_id,
                    "transport": {"tcp": tcp},
                    "request_plane_url": f"dyn://dynamo.{component}.rl",
                    "system_url": url,
                    "model": self._base_model,
                    "routes": list(RL_ROUTES),
                    # Backends that know their parallel size (vLLM) report it;
                    # others leave it out and agents take it from their flag.
                    "world_size": worker.world_size,
                }
            )
        body = {"protocol_version": 1, "namespace": "dynamo", "workers": entries}
        return web.json_response(body)

    async def _place(
        self, model: str, nvext: _NvExt | None, *, logged: tuple[web.Request, bytes] | None = None
    ) -> Placement | web.Response:
        """The workers that run a request for ``model``, each of which logs the
        ``logged`` request (and its body) once placed, or the frontend's refusal."""
        placement = await self._placer.place(model, nvext.targets() if nvext else Targets())
        if isinstance(placement, Refusal):
            return _frontend_error(placement.status, placement.message)
        if logged is not None:
            for worker in placement.workers:
                worker.record(recorded(*logged))
        if not all(generates(worker, model) for worker in placement.workers):
            return _frontend_error(404, "Model not found")
        return placement

    async def _chat(self, request: web.Request) -> web.Response:
        chat = _decode(_CHAT_DECODER, await request.read())
        if isinstance(chat, web.Response):
            return chat
        # Unlike a completion, a chat is not logged (no agent sends one).
        placement = await self._place(chat.model, chat.nvext)
        if isinstance(placement, web.Response):
            return placement
        body = _chat_completion(placement.decode, chat.model)
        return _served(body, placement, chat.nvext)

    async def _completions(self, request: web.Request) -> web.Response:
        raw = await request.read()
        completion = _decode(_COMPLETION_DECODER, raw)
        if isinstance(completion, web.Response):
            return completion
        placement = await self._place(completion.model, completion.nvext, logged=(request, raw))
        if isinstance(placement, web.Response):
            return placement
        body = text_completion(
            placement.decode, completion.model, completion.prompt, completion.max_tokens
        )
        return _served(body, placement, completion.nvext)


def _served(body: dict[str, Any], placement: Placement, nvext: _NvExt | None) -> web.Response:
    """``body`` as the frontend answers it: with the worker ids when the
    request asks for them, and the decode worker in ``x-served-by``."""
    if nvext is not None and nvext.extra_fields and "worker_id" in nvext.extra_fields:
        ids = {
            "prefill_worker_id": placement.prefill.instance_id,
            "decode_worker_id": placement.decode.instance_id,
        }
        body["nvext"] = {"worker_id": ids}
    return web.json_response(body, headers={"x-served-by": placement.decode.worker_id})


def _decode(decoder: msgspec.json.Decoder[_Decoded], raw: bytes) -> _Decoded | web.Response:
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        message = f"Failed to deserialize the JSON body into the target type: {exc}"
        return _frontend_error(400, message)


def _chat_completion(worker: SimWorker, model: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply_text(worker, model)},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        "served_by": worker.worker_id,
    }
