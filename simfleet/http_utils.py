"""Small HTTP helpers shared by the simulator's route modules.

Kept apart so that the worker, frontend and control routes answer errors and
check bearer tokens the same way, the vLLM and SGLang workers list their
models the same way, and a worker's log records a request the same way
whether the worker's own server received it or the frontend routed it there.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Iterable
from typing import Any

from aiohttp import web

from .state import RecordedRequest, SimWorker

__all__ = [
    "UNAUTHORIZED",
    "error_reply",
    "is_authorized",
    "json_or_none",
    "models_reply",
    "plain_text_reply",
    "recorded",
]

#: Body of every 401 answer.
UNAUTHORIZED = {"error": "unauthorized"}


def error_reply(status: int, error: str) -> web.Response:
    """``{"error": <error>}`` with the given status."""
    return web.json_response({"error": error}, status=status)


def plain_text_reply(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text, content_type="text/plain")


def is_authorized(request: web.Request, api_key: str | None) -> bool:
    """True when no key is configured or the request carries ``Bearer <key>``."""
    if api_key is None:
        return True
    presented = request.headers.get("Authorization", "")
    return hmac.compare_digest(presented.encode(), f"Bearer {api_key}".encode())


def json_or_none(raw: bytes) -> Any:
    """The body parsed as JSON, or None when it is empty or not JSON."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def recorded(request: web.Request, raw: bytes, *, prefix: str = "") -> RecordedRequest:
    """``request`` (its body ``raw``) as a worker's log keeps it, with its path
    relative to ``prefix`` (a worker's system URL under the fleet's)."""
    return RecordedRequest(
        method=request.method,
        path=request.path.removeprefix(prefix),
        headers={name.lower(): value for name, value in request.headers.items()},
        body=json_or_none(raw),
        ts=time.time(),
        raw_path=request.raw_path.removeprefix(prefix),
    )


_STARTED = int(time.time())
"""The ``created`` of every model card: the engines give their start time."""


def models_reply(
    worker: SimWorker, *, owned_by: str, adapters: Iterable[str] | None = None, **fields: Any
) -> web.Response:
    """``GET /v1/models`` as vLLM and SGLang answer it: the base model
    (``max_model_len`` 4096), then each adapter (``adapters``, by default every
    one the worker holds), with its path as ``root`` and the base model as
    ``parent``; ``fields``: the engine's own, on every card."""
    base = worker.base_model

    def card(model_id: str, root: str, parent: str | None, max_len: int | None) -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": _STARTED,
            "owned_by": owned_by,
            "root": root,
            "parent": parent,
            "max_model_len": max_len,
            **fields,
        }

    data = [card(base, base, None, 4096)]
    names = worker.adapters if adapters is None else adapters
    data += [card(n, worker.adapter_paths.get(n, ""), base, None) for n in names]
    return web.json_response({"object": "list", "data": data})
