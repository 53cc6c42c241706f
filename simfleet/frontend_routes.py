"""The simulated Dynamo frontend: model list, RL discovery, chat and completions.

It sits at the root of the fleet's server. Like the real frontend it lists the
base model plus the union of adapters any worker holds (listing proves nothing
about every replica), and routes a chat or completion request round-robin only
among the workers that hold the requested model — the strict routing lorabus
tells operators to configure. A completion whose ``nvext.backend_instance_id``
names a worker (its ``instance_id`` in ``/v1/rl/workers``) goes to that worker
only: an agent's canary asks its own engine. A request that lands on a paused
worker is held until that worker resumes, for at most ``paused_wait_s``; one
that reaches a worker whose generation does not know the name (an adapter made
unroutable, :mod:`.generation`) is a 404 "Model not found", as for a name no
worker holds. Dynamo's workers serve no generation route of their own: the
frontend records a completion in the log of the worker it routed it to, as
``POST /v1/completions``.

Shapes follow a real Dynamo 1.6.1 frontend: errors are flat
``{"message", "type", "code"}`` bodies (``{"message": "Model not found",
"type": "Not Found", "code": 404}``), and each ``/v1/rl/workers`` entry
describes the worker's ``rl`` endpoint (``endpoint``, ``transport``,
``request_plane_url``) with a full 64-bit ``instance_id`` and no
``admin_base_url``. A completion answers OpenAI's ``text_completion``.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
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
from .state import SimWorker

__all__ = ["PAUSED_WAIT_S", "RL_ROUTES", "FrontendRoutes"]

#: How long a generation request waits for a paused worker before a 503.
PAUSED_WAIT_S = 30.0

#: System routes every simulated worker advertises in RL discovery.
RL_ROUTES = ("liveness_probe", "load_lora", "pause_generation", "resume_generation", "unload_lora")


class _ChatRequest(msgspec.Struct):
    model: str
    messages: list[Any]


class _NvExt(msgspec.Struct):
    backend_instance_id: int | None = None


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
        self._paused_wait_s = paused_wait_s
        self._created = int(time.time())
        self._turns: dict[str, itertools.count[int]] = {}

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
            tcp = f"{urlsplit(url).netloc}/{worker.instance_id:016x}/dynamo/backend/rl"
            entries.append(
                {
                    "namespace": "dynamo",
                    "component": "backend",
                    "endpoint": "rl",
                    "instance_id": worker.instance_id,
                    "transport": {"tcp": tcp},
                    "request_plane_url": "dyn://dynamo.backend.rl",
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

    def _holders(self, model: str) -> list[SimWorker]:
        if model == self._base_model:
            return list(self._workers.values())
        return [w for w in self._workers.values() if model in w.adapters]

    def _next_holder(self, model: str) -> SimWorker | None:
        holders = self._holders(model)
        if not holders:
            return None
        turn = next(self._turns.setdefault(model, itertools.count()))
        return holders[turn % len(holders)]

    async def _route(
        self, model: str, pick: Callable[[str], SimWorker | None]
    ) -> SimWorker | web.Response:
        """The worker ``pick`` chooses for ``model``, once it is not paused; a 404
        when it chooses none, a 503 when the worker stays paused too long."""
        try:
            async with asyncio.timeout(self._paused_wait_s):
                while True:
                    worker = pick(model)
                    if worker is None:
                        return _frontend_error(404, "Model not found")
                    if not await worker.wait_resumed():
                        return _frontend_error(503, "simulated fleet is stopping")
                    # It may have dropped the adapter while paused: route again.
                    if worker in self._holders(model):
                        return worker
        except TimeoutError:
            message = f"worker for model '{model}' stayed paused for {self._paused_wait_s} s"
            return _frontend_error(503, message)

    def _if_holder(self, worker: SimWorker, model: str) -> SimWorker | None:
        """``worker`` when it holds ``model``: the only choice of a targeted request."""
        return worker if worker in self._holders(model) else None

    def _instance(self, instance_id: int) -> SimWorker | None:
        return next((w for w in self._workers.values() if w.instance_id == instance_id), None)

    async def _chat(self, request: web.Request) -> web.Response:
        chat = _decode(_CHAT_DECODER, await request.read())
        if isinstance(chat, web.Response):
            return chat
        worker = await self._route(chat.model, self._next_holder)
        if isinstance(worker, web.Response):
            return worker
        if not generates(worker, chat.model):
            return _frontend_error(404, "Model not found")
        return _chat_completion(worker, chat.model)

    async def _completions(self, request: web.Request) -> web.Response:
        raw = await request.read()
        completion = _decode(_COMPLETION_DECODER, raw)
        if isinstance(completion, web.Response):
            return completion
        target = completion.nvext.backend_instance_id if completion.nvext else None
        if target is None:
            pick = self._next_holder
        else:
            chosen = self._instance(target)
            if chosen is None:
                return _frontend_error(404, f"No worker with instance id {target}")
            pick = functools.partial(self._if_holder, chosen)
        worker = await self._route(completion.model, pick)
        if isinstance(worker, web.Response):
            return worker
        worker.record(recorded(request, raw))
        if not generates(worker, completion.model):
            return _frontend_error(404, "Model not found")
        body = text_completion(worker, completion.model, completion.prompt, completion.max_tokens)
        return web.json_response(body, headers={"x-served-by": worker.worker_id})


def _decode(decoder: msgspec.json.Decoder[_Decoded], raw: bytes) -> _Decoded | web.Response:
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        message = f"Failed to deserialize the JSON body into the target type: {exc}"
        return _frontend_error(400, message)


def _chat_completion(worker: SimWorker, model: str) -> web.Response:
    body = {
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
    return web.json_response(body, headers={"x-served-by": worker.worker_id})
