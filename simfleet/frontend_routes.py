"""The simulated Dynamo frontend: model list, RL discovery and chat routing.

It sits at the root of the fleet's server. Like the real frontend it lists the
base model plus the union of adapters any worker holds (listing proves nothing
about every replica), and routes a chat request round-robin only among the
workers that hold the requested model — the strict routing lorabus tells
operators to configure. A request that lands on a paused worker is held until
that worker resumes, for at most ``paused_wait_s``.

Shapes follow a real Dynamo 1.6.1 frontend: errors are flat
``{"message", "type", "code"}`` bodies (``{"message": "Model not found",
"type": "Not Found", "code": 404}``), and each ``/v1/rl/workers`` entry
describes the worker's ``rl`` endpoint (``endpoint``, ``transport``,
``request_plane_url``) with a full 64-bit ``instance_id`` and no
``admin_base_url``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from .http_utils import UNAUTHORIZED, is_authorized
from .state import SimWorker

__all__ = ["PAUSED_WAIT_S", "RL_ROUTES", "FrontendRoutes"]

#: How long a generation request waits for a paused worker before a 503.
PAUSED_WAIT_S = 30.0

#: System routes every simulated worker advertises in RL discovery.
RL_ROUTES = ("liveness_probe", "load_lora", "pause_generation", "resume_generation", "unload_lora")


class _ChatRequest(msgspec.Struct):
    model: str
    messages: list[Any]


_CHAT_DECODER = msgspec.json.Decoder(_ChatRequest)

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

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            chat = _CHAT_DECODER.decode(await request.read())
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            message = f"Failed to deserialize the JSON body into the target type: {exc}"
            return _frontend_error(400, message)
        model = chat.model
        try:
            async with asyncio.timeout(self._paused_wait_s):
                while True:
                    worker = self._next_holder(model)
                    if worker is None:
                        return _frontend_error(404, "Model not found")
                    if not await worker.wait_resumed():
                        return _frontend_error(503, "simulated fleet is stopping")
                    # It may have dropped the adapter while paused: route again.
                    if worker in self._holders(model):
                        break
        except TimeoutError:
            message = f"worker for model '{model}' stayed paused for {self._paused_wait_s} s"
            return _frontend_error(503, message)
        return _completion(worker, model)


def _completion(worker: SimWorker, model: str) -> web.Response:
    content = f"simulated reply from worker {worker.worker_id} using model {model}"
    body = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        "served_by": worker.worker_id,
    }
    return web.json_response(body, headers={"x-served-by": worker.worker_id})
