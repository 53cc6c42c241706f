"""Driver for an NVIDIA Dynamo worker's system server (README: Running against NVIDIA Dynamo).

Every path and payload of Dynamo's LoRA and engine-control API lives here and
nowhere else: these APIs are experimental upstream and change between releases.
Checked against a real Dynamo 1.6.1 runtime by the ``real_dynamo`` test tier.

Dynamo's ``/engine/...`` routes answer every failure of the engine's handler
with HTTP **200** and ``{"status": "error", "message": ...}`` (and label their
JSON ``text/plain``), while ``/v1/loras`` answers a failed load with a 500
(older releases: 200 with an error body too); so the body is checked as well
as the status code.

Names go into URLs one percent-encoded segment each (``quote(name,
safe='')``), so ``org/policy-v1`` is sent as ``/v1/loras/org%2Fpolicy-v1``:
Dynamo's route is ``/v1/loras/{*lora_name}`` and axum's ``Path`` extractor
decodes it back to ``org/policy-v1``, while ``?``, ``#``, ``%`` or a ``/``
cannot reach another route. The segments ``.`` and ``..`` are refused, since
HTTP clients resolve them away (httpx sends ``DELETE /v1/loras/..`` as
``DELETE /v1``).

Retries: a failed call is retried only when asking again may succeed: no
answer (a connection error, a timeout), a 5xx (502, 503 and 504 from a proxy
or a worker starting up; a 500 from a handler, e.g. "Local LoRA not found"
while a shared filesystem does not show a fresh directory yet), a 408 or 429,
or an older release's status-200 error body. The rest is final and fails the
call at once: any other 4xx (a bad request, a refused token, a route the
worker does not serve), and an answer that says the directory holds no
adapter (vLLM's "No adapter found for <path>" when ``adapter_config.json`` is
missing, in a 500) or that the worker has no LoRA support: asking again gets
the same answer while every engine of the update waits paused.

Pause asks for ``keep`` mode (in-flight requests are held, then continue).
Dynamo 1.6.1's vLLM backend refuses ``keep`` while requests for a LoRA
adapter are in flight; the driver then pauses in ``wait`` mode, which lets
those requests finish first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import quote

import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from lorabus.agents.config import ENGINE_TIMEOUT_S
from lorabus.errors import BadRequest, EngineError

log = logging.getLogger(__name__)

PAUSE_BODY = {"mode": "keep", "clear_cache": False}
PAUSE_WAIT_BODY = {"mode": "wait", "clear_cache": False}
#: How Dynamo's vLLM handler refuses a keep-mode pause (dynamo/vllm/handlers.py).
KEEP_REFUSED = "Cannot pause generation in keep mode with active LoRA requests"
#: Words of an engine error that asking again cannot fix. vLLM raises
#: ``LoRAAdapterNotFoundError`` ("Loading lora <name> failed: No adapter found
#: for <path>", vllm/exceptions.py) when the directory has no readable
#: ``adapter_config.json``, and Dynamo's vLLM handler answers it in a 500 as
#: "Failed to add LoRA '<name>': <that>"; a worker whose backend has no LoRA
#: support answers "LoRA management not available: ..." (seen on Dynamo 1.6.1).
FINAL_ERROR_WORDS = ("No adapter found for", "LoRA management not available")
#: Client errors that mean "not now" rather than "never".
TRANSIENT_CLIENT_STATUSES = frozenset({408, 429})


def _is_transient(status: int | None, message: str) -> bool:
    """Whether an engine call that failed with ``status`` (None: no answer) and
    ``message`` may succeed if asked again (the module docstring says which)."""
    if any(words in message for words in FINAL_ERROR_WORDS):
        return False
    if status is None or status < 400 or status >= 500:
        return True
    return status in TRANSIENT_CLIENT_STATUSES


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, EngineError) and exc.retryable


class DynamoDriver:
    """Drives one Dynamo worker through its system server at ``system_url``."""

    kind = "dynamo"

    def __init__(
        self,
        system_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = ENGINE_TIMEOUT_S,
        attempts: int = 5,
    ) -> None:
        self.system_url = system_url.rstrip("/")
        self._attempts = attempts
        self._http = httpx.AsyncClient(
            base_url=self.system_url,
            headers=dict(headers or {}),
            timeout=httpx.Timeout(timeout_s),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def pause(self) -> None:
        try:
            await self._call("POST", "/engine/pause_generation", PAUSE_BODY)
        except EngineError as exc:
            if KEEP_REFUSED not in str(exc):
                raise
            log.info(
                "%s refused a keep-mode pause (%s); pausing in wait mode", self.system_url, exc
            )
            await self._call("POST", "/engine/pause_generation", PAUSE_WAIT_BODY)

    async def resume(self) -> None:
        # A lost resume leaves an engine paused: retry transient failures (the
        # caller's command budget bounds the whole).
        await self._retrying(
            lambda: self._call("POST", "/engine/resume_generation", {}), float("inf")
        )

    async def load_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        try:
            uri = PurePosixPath(path).as_uri()
        except ValueError as exc:
            raise EngineError(f"adapter path {path!r} is not absolute") from exc
        body = {"lora_name": name, "source": {"uri": uri}}
        # A shared filesystem can show a fresh adapter directory late ("Local
        # LoRA not found", a 500): retried. A directory the engine read and
        # found no adapter in is final, and so is a 4xx (see _is_transient).
        await self._retrying(lambda: self._call("POST", "/v1/loras", body), budget_s)

    async def unload_adapter(self, name: str) -> None:
        await self._call("DELETE", f"/v1/loras/{_url_segment(name)}")

    async def list_adapters(self) -> list[str]:
        body = await self._call("GET", "/v1/loras")
        loras = body.get("loras", {})
        if not isinstance(loras, dict):
            raise EngineError(f"GET /v1/loras answered an unexpected body: {body!r}")
        return sorted(loras)

    async def _retrying(self, call: Any, budget_s: float) -> None:
        """Run ``call``, again while it fails transiently, within ``budget_s``
        and the driver's attempts; the error says whether it was retried."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self._attempts) | stop_after_delay(max(budget_s, 0.0)),
            wait=wait_exponential(multiplier=0.1, max=2.0) + wait_random(0, 0.1),
            retry=retry_if_exception(_is_retryable),
            reraise=True,
        )
        attempts = 0
        try:
            async for attempt in retrying:
                with attempt:
                    attempts += 1
                    await call()
        except EngineError as exc:
            if exc.retryable:
                note = f"gave up after {attempts} attempt{'s' if attempts > 1 else ''}"
            else:
                note = "final: not retried" if attempts == 1 else f"final at attempt {attempts}"
            raise type(exc)(f"{exc} ({note})", retryable=exc.retryable, status=exc.status) from exc

    async def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        what = f"{method} {self.system_url}{path}"
        try:
            response = await self._http.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise EngineError(
                f"{what} failed: {type(exc).__name__}: {exc}", retryable=True
            ) from exc
        payload = _json_or_none(response)
        status = response.status_code
        if status >= 400:
            message = _message(payload, response.text)
            raise EngineError(
                f"{what} answered {status}: {message}",
                retryable=_is_transient(status, message),
                status=status,
            )
        if isinstance(payload, dict) and payload.get("status") == "error":
            # Engine routes report every failure this way, and older releases
            # a failed load too (the same failure as a later 500: retry alike).
            message = _message(payload, response.text)
            raise EngineError(
                f"{what} answered {status} with an error: {message}",
                retryable=_is_transient(status, message),
                status=status,
            )
        return payload if isinstance(payload, dict) else {}


def _url_segment(value: str) -> str:
    """``value`` as exactly one URL path segment: every reserved character
    percent-encoded, and no segment that a client or server would resolve."""
    if value in ("", ".", ".."):
        raise BadRequest(f"{value!r} cannot stand as a URL path segment")
    return quote(value, safe="")


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _message(payload: Any, text: str) -> str:
    if isinstance(payload, dict):
        for key in ("message", "error", "detail"):
            value = payload.get(key)
            if isinstance(value, str) and value:
                return value
    return text.strip()[:500] or "(empty body)"
