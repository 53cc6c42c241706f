"""Small HTTP helpers shared by the simulator's route modules.

Kept apart so that the worker, frontend and control routes answer errors and
check bearer tokens the same way.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from aiohttp import web

__all__ = [
    "UNAUTHORIZED",
    "error_reply",
    "is_authorized",
    "json_or_none",
    "plain_text_reply",
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
