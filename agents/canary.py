"""How a driver asks its engine for the canary's one token, and reads the answer.

What is asked and what counts as an answer is :mod:`lorabus.canary`'s; here
is the HTTP side shared by the drivers: an error answer is classified as
any engine call's (a 5xx or no answer is asked again within the budget, a
4xx is final), and its message is the engine's own words.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lorabus.agents.http_engine import (
    EngineAnswer,
    HttpEngine,
    error_message,
    is_transient,
    json_or_none,
)
from lorabus.canary import read_completion, read_generated
from lorabus.errors import CanaryFailed

__all__ = ["completion_of", "generated", "generation_of"]


def completion_of(name: str) -> Callable[[EngineAnswer], str]:
    """Reads an OpenAI completion answered as ``name``."""

    def read(answer: EngineAnswer) -> str:
        _raise_for_error(answer)
        return read_completion(answer.status_code, answer.content, _what(answer), name)

    return read


def generation_of(answer: EngineAnswer) -> str:
    """Reads a native generation (SGLang's ``/generate``)."""
    _raise_for_error(answer)
    return read_generated(answer.status_code, answer.content, _what(answer))


async def generated(
    engine: HttpEngine,
    path: str,
    body: dict[str, Any],
    read: Callable[[EngineAnswer], str],
    budget_s: float,
    *,
    headers: Mapping[str, str] | None = None,
) -> str:
    """``POST path`` with ``body`` (and ``headers``) on ``engine`` and the text
    ``read`` finds in the answer, asked again while it fails transiently,
    within ``budget_s``."""
    texts: list[str] = []

    async def ask() -> None:
        texts.append(read(await engine.request("POST", path, body, headers=headers)))

    await engine.retrying(ask, budget_s)
    return texts[-1]


def _what(answer: EngineAnswer) -> str:
    return f"{answer.method} {answer.url}"


def _raise_for_error(answer: EngineAnswer) -> None:
    if answer.status_code < 400:
        return
    message = error_message(json_or_none(answer), answer.text)
    raise CanaryFailed(
        f"{_what(answer)} answered {answer.status_code}: {message[:300]}",
        retryable=is_transient(answer.status_code, message),
        status=answer.status_code,
    )
