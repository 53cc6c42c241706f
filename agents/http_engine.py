"""What every engine driver shares: one HTTP client, one retry policy, one error reading.

The Dynamo, vLLM and SGLang drivers differ in paths, payloads and how an
answer says it failed; they agree on everything here, so that an update sees
the same behaviour from every engine kind of a mixed fleet:

- One connection pool per driver (httpcore, the transport under httpx), with
  the agent's headers (auth) on every call and a timeout on every call (one
  to connect, shorter: ``ENGINE_CONNECT_TIMEOUT_S``); a
  call to a control route (``admin``) carries the admin headers in place of
  the same-named ones (SGLang's ``--admin-api-key``). An
  agent makes four calls an update on one engine, and the client layer of
  httpx (request and URL models, cookies, redirects) costs more CPU than the
  transport below it: calling the transport directly takes about 40% less
  CPU per call. It reads no proxy settings from the environment: an agent
  talks to the engine beside it.
- Errors: every failure is an :class:`~lorabus.errors.EngineError` that says
  whether asking again may succeed (``retryable``) and carries the HTTP status.
- Retries (:meth:`HttpEngine.retrying`): only transient failures are retried,
  within the caller's budget and the driver's attempts. Transient: no answer
  (a connection error, a timeout), a 5xx (502, 503 and 504 from a proxy or an
  engine starting up; a 500 from a handler, e.g. Dynamo's "Local LoRA not
  found" while a shared filesystem does not show a fresh directory yet), a 408
  or 429, or an answer that says it failed in a 2xx (older Dynamo). Final, so
  failing the call at once: any other 4xx (a bad request, a refused token, a
  route the engine does not serve, vLLM's 404 for a directory without an
  adapter, every SGLang refusal), and an answer whose words say the directory
  holds no adapter or the engine has no LoRA support: asking again gets the
  same answer while every engine of the update waits paused.
- Set-up problems: a driver may say, without changing anything, what keeps
  its engine from taking LoRA updates at all (:meth:`HttpEngine.setup_problem`,
  None by default): a route the engine was started without, a parallel
  layout it refuses updates in. FastAPI, under vLLM and SGLang, answers a
  path no route serves with 404 ``{"detail": "Not Found"}``
  (:func:`route_not_served`), unlike the engines' own 404s (vLLM:
  ``{"error": {...}}``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlencode, urlsplit, urlunsplit

import httpcore
import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)

from lorabus._version import __version__
from lorabus.agents.config import ENGINE_CONNECT_TIMEOUT_S, ENGINE_TIMEOUT_S, check_engine_url
from lorabus.bus.connect import redact
from lorabus.errors import BadRequest, EngineError

__all__ = [
    "FINAL_ERROR_WORDS",
    "TRANSIENT_CLIENT_STATUSES",
    "EngineAnswer",
    "HttpEngine",
    "error_message",
    "is_transient",
    "json_or_none",
    "route_not_served",
    "url_segment",
]

#: Words of an engine error that asking again cannot fix. vLLM raises
#: ``LoRAAdapterNotFoundError`` ("Loading lora <name> failed: No adapter found
#: for <path>", vllm/exceptions.py) when the directory has no readable
#: ``adapter_config.json`` (Dynamo's vLLM handler answers it in a 500, vLLM's
#: own server in a 404); a Dynamo worker whose backend has no LoRA support
#: answers "LoRA management not available: ..." (seen on Dynamo 1.6.1).
FINAL_ERROR_WORDS = (
    "No adapter found for",
    "LoRA management not available",
    # vLLM answers it 500, but the adapter's rank will not change on a retry.
    "is greater than max_lora_rank",
    # SGLang's assert with more than one data-parallel replica
    # (srt/managers/tokenizer_control_mixin.py); SGLang itself answers a bare
    # 500 "Internal Server Error" (sglang.py asks its data-parallel size), a
    # proxy that passes the handler's words on gives these.
    "data-parallel replicas are not supported for dynamic lora loading",
)
#: Client errors that mean "not now" rather than "never".
TRANSIENT_CLIENT_STATUSES = frozenset({408, 429})


def is_transient(status: int | None, message: str) -> bool:
    """Whether an engine call that failed with ``status`` (None: no answer) and
    ``message`` may succeed if asked again (the module docstring says which)."""
    if any(words in message for words in FINAL_ERROR_WORDS):
        return False
    if status is None or status < 400 or status >= 500:
        return True
    return status in TRANSIENT_CLIENT_STATUSES


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, EngineError) and exc.retryable


_NO_ANSWER = (
    httpcore.TimeoutException,
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.ProxyError,
    httpcore.UnsupportedProtocol,
    httpcore.ConnectionNotAvailable,
)
"""What the transport raises when a call got no answer (httpx's TransportError)."""
_KEEPALIVE_S = 5.0
"""How long an idle connection is reused: httpx's default."""
_BODYLESS = frozenset({"GET", "HEAD"})
_USER_AGENT = f"lorabus/{__version__}"
_JSON_TYPE = (b"Content-Type", b"application/json")


@dataclass(frozen=True)
class EngineAnswer:
    """An engine's answer to one call: what the drivers read of it."""

    method: str
    url: str
    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; raises ValueError when it is not (deep nesting included)."""
        try:
            return json.loads(self.content)
        except RecursionError as exc:
            raise ValueError("the answer nests too deeply") from exc


class HttpEngine:
    """The HTTP side of a driver: a client on ``base_url`` and the retry policy.

    Subclasses add the engine's routes and read its answers; :meth:`send`
    turns a missing answer or an HTTP error status into an ``EngineError``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        admin_headers: Mapping[str, str] | None = None,
        timeout_s: float = ENGINE_TIMEOUT_S,
        attempts: int = 5,
        connect_timeout_s: float = ENGINE_CONNECT_TIMEOUT_S,
    ) -> None:
        check_engine_url(base_url)
        parts = urlsplit(base_url.rstrip("/"))
        host = parts.netloc.rpartition("@")[2]
        self._url = urlunsplit(parts._replace(netloc=host))
        """The URL requests go to: a user and password in it become a header."""
        self.base_url = redact(self._url)
        """The URL messages show."""
        self._attempts = attempts
        given = dict(headers or {})
        named = {name.lower() for name in given}
        # httpx's own headers, each unless the agent's configuration sets it.
        own = {"Host": host, "User-Agent": _USER_AGENT, "Accept": "*/*"}
        if parts.username is not None:
            user, password = unquote(parts.username), unquote(parts.password or "")
            basic = base64.b64encode(f"{user}:{password}".encode()).decode()
            own["Authorization"] = f"Basic {basic}"
        own = {name: value for name, value in own.items() if name.lower() not in named}
        self._headers = _encoded({**own, **given})
        admin = dict(admin_headers or {})
        kept = {n: v for n, v in {**own, **given}.items() if n.lower() not in _lower(admin)}
        self._admin_headers = _encoded({**kept, **admin})
        """On control routes: the admin headers in place of the same-named ones."""
        self._json_type = [] if "content-type" in named else [_JSON_TYPE]
        self._extensions = {
            "timeout": {
                **dict.fromkeys(("read", "write", "pool"), timeout_s),
                "connect": min(connect_timeout_s, timeout_s),
            }
        }
        # One context for the pool's connections (httpcore would make one per
        # connection), trusting what httpx trusts; none for plain HTTP.
        context = httpx.create_ssl_context() if parts.scheme == "https" else None
        self._http = httpcore.AsyncConnectionPool(
            ssl_context=context, keepalive_expiry=_KEEPALIVE_S
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        admin: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> EngineAnswer:
        """``method path`` with ``body`` as JSON, and the answer whatever its
        status; an EngineError only when no answer came. ``admin``: a control
        route, sent with the admin headers; ``headers``: added to this call."""
        what = f"{method} {self.base_url}{path}"
        where = path + (f"?{urlencode(params)}" if params else "")
        sent = list(self._admin_headers if admin else self._headers)
        sent += _encoded(headers or {})
        content = b""
        if body is not None:
            content = json.dumps(
                body, ensure_ascii=False, separators=(",", ":"), allow_nan=False
            ).encode()
            sent += self._json_type
        if content or method not in _BODYLESS:
            sent.append((b"Content-Length", str(len(content)).encode()))
        try:
            answer = await self._http.request(
                method,
                self._url + where,
                headers=sent,
                content=content,
                extensions=self._extensions,
            )
        except _NO_ANSWER as exc:
            raise EngineError(
                f"{what} failed: {type(exc).__name__}: {exc}", retryable=True
            ) from exc
        return EngineAnswer(method, self.base_url + where, answer.status, answer.content)

    async def send(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        admin: bool = False,
    ) -> EngineAnswer:
        """:meth:`request`, and the answer if its status is below 400, else the
        driver's :meth:`failure` of it."""
        response = await self.request(method, path, body, params=params, admin=admin)
        if response.status_code >= 400:
            raise self.failure(path, response)
        return response

    def failure(self, path: str, response: EngineAnswer) -> EngineError:
        """The error an answer of status 400 or more to ``path`` makes, classified
        by status and message (a driver that knows more of its engine says more)."""
        status = response.status_code
        message = error_message(json_or_none(response), response.text)
        return EngineError(
            f"{response.method} {self.base_url}{path} answered {status}: {message}",
            retryable=is_transient(status, message),
            status=status,
        )

    async def setup_problem(self) -> str | None:
        """What keeps the engine from taking LoRA updates however often asked
        (a route it was started without, a layout it refuses updates in) and
        how to fix it, found without changing anything; None when nothing is
        known to. Raises EngineError when the engine does not answer."""
        return None

    async def served_adapters(self) -> dict[str, str]:
        """``GET /v1/models`` of an OpenAI-compatible server (vLLM, SGLang): each
        adapter's name and the path it was loaded from. Adapters are the
        entries with a ``parent`` (the base model); their ``root`` is the path."""
        response = await self.send("GET", "/v1/models")
        payload = json_or_none(response)
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list):
            raise EngineError(
                f"GET {self.base_url}/v1/models answered an unexpected body: {payload!r}"
            )
        adapters = {}
        for entry in data:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                raise EngineError(
                    f"GET {self.base_url}/v1/models listed an entry without an id: {entry!r}"
                )
            if entry.get("parent"):
                root = entry.get("root")
                adapters[entry["id"]] = root if isinstance(root, str) else ""
        return adapters

    async def retrying(self, call: Callable[[], Awaitable[object]], budget_s: float) -> None:
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


def url_segment(value: str) -> str:
    """``value`` as exactly one URL path segment: every reserved character
    percent-encoded, and no segment that a client or server would resolve."""
    if value in ("", ".", ".."):
        raise BadRequest(f"{value!r} cannot stand as a URL path segment")
    return quote(value, safe="")


def route_not_served(response: EngineAnswer) -> bool:
    """Whether ``response`` is FastAPI's answer for a path no route serves (vLLM,
    SGLang): 404 ``{"detail": "Not Found"}``. An engine's own 404s say more."""
    return response.status_code == 404 and json_or_none(response) == {"detail": "Not Found"}


def _encoded(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [(name.encode(), value.encode()) for name, value in headers.items()]


def _lower(headers: Mapping[str, str]) -> set[str]:
    return {name.lower() for name in headers}


def json_or_none(response: EngineAnswer) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def error_message(payload: Any, text: str) -> str:
    """What an error answer says: Dynamo's ``message``/``error``, vLLM's nested
    ``{"error": {"message": ...}}``, SGLang's ``error_message``, FastAPI's
    ``detail``, else the text itself."""
    if isinstance(payload, dict):
        for key in ("message", "error_message", "error", "detail"):
            value = payload.get(key)
            if isinstance(value, dict):
                value = value.get("message")
            if isinstance(value, str) and value:
                return value
    return text.strip()[:500] or "(empty body)"
