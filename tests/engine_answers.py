"""The same request to a real engine and to the simulated one, answers compared.

Used by the real tiers' comparisons (``tests/real_dynamo/test_real_vs_sim.py``,
``tests/real_vllm/test_vllm_vs_sim.py``): each sends its engine's cases to
both, normalizes what may differ by nature (ids, paths of other tests), and
compares status, content type and body.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Case:
    what: str
    method: str
    path: str
    body: Any = None
    raw: bytes | None = None
    headers: Mapping[str, str] | None = None
    #: Compare only the start of the message (or text) up to this many characters.
    prefix: int | None = None
    #: Compare only these fields of a JSON body.
    only: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Answer:
    status: int
    mime: str
    body: Any


async def ask(
    http: httpx.AsyncClient, base: str, case: Case, normalize: Callable[[Any, Case], Any]
) -> Answer:
    """``case`` sent to the engine at ``base``: JSON bodies decoded, others as text."""
    content = case.raw
    headers = dict(case.headers or {})
    if case.body is not None:
        content = httpx.Request("POST", "/", json=case.body).content
        headers.setdefault("content-type", "application/json")
    reply = await http.request(case.method, base + case.path, content=content, headers=headers)
    try:
        body: Any = reply.json()
    except ValueError:
        body = reply.text
    mime = reply.headers.get("content-type", "").split(";")[0]
    return Answer(reply.status_code, mime, normalize(body, case))
