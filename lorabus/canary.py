"""The canary's request and how its answer is read: one generated token with an
adapter's served name, as proof that the name serves.

An engine's adapter list, and a frontend's model list, can show a name that
no request can use (Dynamo #11163: a load that succeeded but whose route was
never published; a registration under the wrong block size), so after a
load each member asks its own engine for one token with the served name,
greedy, from a fixed prompt (``agents/canary.py``), and the coordinator asks
the frontend once (``coordinator/frontend.py``). The generation is the
smallest an engine does: one prefill of a few tokens and one decode step.

A completion counts only when it is a completion *of that name* (its
``model``) with a choice; SGLang's native generation names no model, and
its route refuses a name it does not serve, so an answer there is one of it.
"""

from __future__ import annotations

import json
from typing import Any

from lorabus.errors import CanaryFailed

__all__ = ["CANARY_PROMPT", "completion_body", "read_completion", "read_generated"]

CANARY_PROMPT = "The capital of France is"
"""Short, and answered by any base model in one token."""
_SHOWN = 300
"""The most of an unexpected answer an error message repeats."""


def completion_body(model: str) -> dict[str, Any]:
    """An OpenAI ``/v1/completions`` body for one greedy token from ``model``."""
    return {"model": model, "prompt": CANARY_PROMPT, "max_tokens": 1, "temperature": 0}


def read_completion(status: int, content: bytes, what: str, name: str) -> str:
    """The text of an OpenAI completion that ``what`` (``POST <url>``) answered
    with ``status`` and ``content`` as ``name``; CanaryFailed otherwise."""
    payload = _payload_of(status, content, what)
    if payload.get("model") != name:
        raise _failed(what, content, f"answered as model {payload.get('model')!r}, not {name!r}")
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _failed(what, content, "answered without a choice")
    text = choices[0].get("text")
    if not isinstance(text, str):
        raise _failed(what, content, "answered a choice without text")
    return text


def read_generated(status: int, content: bytes, what: str) -> str:
    """The text of a native generation (SGLang's ``/generate``: ``{"text",
    "meta_info"}``); CanaryFailed when there is none."""
    text = _payload_of(status, content, what).get("text")
    if not isinstance(text, str):
        raise _failed(what, content, "answered without a generated text")
    return text


def _payload_of(status: int, content: bytes, what: str) -> dict[str, Any]:
    if status >= 400:
        # The callers classify the status (retry or not); this says what failed.
        raise CanaryFailed(f"{what} answered {status}: {_shown(content)}", status=status)
    try:
        payload = json.loads(content)
    except (ValueError, RecursionError):
        payload = None
    if not isinstance(payload, dict):
        raise _failed(what, content, "answered no JSON object")
    return payload


def _shown(content: bytes) -> str:
    return content.decode("utf-8", errors="replace")[:_SHOWN]


def _failed(what: str, content: bytes, how: str) -> CanaryFailed:
    return CanaryFailed(f"{what} {how}: {_shown(content)!r}")
