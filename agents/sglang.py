"""Driver for an SGLang server (``python -m sglang.launch_server --enable-lora``).

Every path and payload of SGLang's LoRA and pause API lives here and nowhere
else. Checked against the source of SGLang 0.5.23 (the release the package
index offers here): ``python/sglang/srt/entrypoints/http_server.py`` (the
routes), ``srt/managers/io_struct.py`` (``PauseGenerationReqInput``,
``LoadLoRAAdapterReqInput``, ``LoRAUpdateOutput``),
``srt/managers/tokenizer_control_mixin.py`` and ``srt/lora/lora_manager.py``,
``srt/lora/lora_registry.py`` (the error messages) and ``srt/utils/auth.py``.

What SGLang answers:

- ``POST /load_lora_adapter {"lora_name", "lora_path"}`` and ``POST
  /unload_lora_adapter {"lora_name"}``: ``{"success", "error_message",
  "loaded_adapters"}`` (plus ``rid`` and ``http_worker_ipc``, null), **200**
  when ``success`` is true and **400** for every failure, whatever its cause:
  a path without an adapter, LoRA not enabled, a name already loaded ("Failed
  to load LoRA adapter <name> because it is already loaded"), an unknown name
  on unload ("LoRA with name <name> does not exist. ..."). ``loaded_adapters``
  maps each loaded name to its path.
- ``GET /v1/models``: the served model and one entry per adapter with
  ``root`` (its path) and ``parent`` (the served model). SGLang has no other
  route that lists adapters without changing them, so this is the read-back.
- ``POST /pause_generation {"mode": "abort"|"retract"|"in_place"}`` and ``POST
  /continue_generation {}``: ``{"message": ..., "status": "ok"}``; a body that
  does not validate is a 400 ``{"object": "error", "message", "type", "code"}``.
- Keys (``srt/utils/auth.py``, ``decide_request_auth``; the routes' levels in
  ``http_server.py``): the LoRA, pause and continue routes are marked
  ``ADMIN_OPTIONAL``: with ``--admin-api-key`` they take that key only (the
  API key is refused there), else the ``--api-key``. ``/v1/models`` and
  ``/server_info`` are ``NORMAL``: with ``--api-key`` they take that key only
  (the admin key is refused there), else anyone. ``/health*``, ``/ready*``
  and ``/metrics*`` are always open. A refusal is 401 ``{"error":
  "Unauthorized"}``. So with both keys the driver sends the admin headers
  (``--admin-api-key-env``) on the control routes and the API key on the
  read-back.
- Data parallelism: ``load_lora_adapter`` and ``unload_lora_adapter`` of
  ``srt/managers/tokenizer_control_mixin.py`` ``assert get_parallel().dp_size
  == 1, "data-parallel replicas are not supported for dynamic lora loading"``.
  The ``AssertionError`` escapes the handler (it catches ``ValueError`` only,
  and the app registers no handler for it), so the client gets Starlette's
  bare 500 ``Internal Server Error`` in plain text, like any crashed handler.
  The driver then reads ``GET /server_info`` (``dp_size``, one of the
  resolved server arguments it lists; ``/get_server_info`` on older releases):
  above 1, the failure is final and says so. The agent asks the same at start
  (:meth:`SglangDriver.setup_problem`) and reports its worker not ready, with
  the reason, until the engine runs with ``--dp-size 1``.

Pause uses ``in_place``: the scheduler stops stepping and keeps running
requests and their KV cache where they are, continuing them after
``/continue_generation``; ``abort`` (SGLang's default) would fail them and
``retract`` would move them back to the queue and recompute their KV cache.
A new adapter name does not touch the adapters running requests use.

An unload, though, waits for the requests running on its adapter, holding
SGLang's LoRA update lock (``LoRARegistry.unregister`` waits for the
adapter's in-flight counter to reach zero; a retracted request still
counts): under an ``in_place`` pause they never finish, and the unload
would hang until its budget ran out. So ``unload_waits_for_running`` is
set, and an agent that must unload a name its paused engine serves (a
fixed-name replace) lets generation continue for the unload, then pauses
again before it loads.

Since SGLang answers every refusal with a 400, its load errors are final
(:mod:`lorabus.agents.http_engine`); no answer, a 5xx (a proxy, a crashed
handler), 408 or 429 are retried within the load's budget. A load of a name
SGLang already holds is read back as the vLLM driver does: done when that
name was loaded from the same path, a final error when from another.
Names travel only in JSON bodies, never in URLs.

The canary (:mod:`lorabus.agents.canary`) asks ``POST /generate`` with the
adapter's name as ``lora_path`` (a name SGLang does not hold is refused with
a 400), for one greedy token. After a fixed-name replace the driver asks
``POST /flush_cache`` (a control route: the admin key) to drop prefixes the
old weights computed; SGLang refuses it (400) while any request runs or
waits, which a pause keeps, and the driver then logs it and goes on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from lorabus.agents.canary import generated, generation_of
from lorabus.agents.http_engine import (
    EngineAnswer,
    HttpEngine,
    error_message,
    is_transient,
    json_or_none,
    route_not_served,
)
from lorabus.canary import CANARY_PROMPT
from lorabus.errors import EngineError

__all__ = ["SglangDriver"]

log = logging.getLogger(__name__)

PAUSE_BODY = {"mode": "in_place"}
#: How SGLang refuses a load of a name it holds: the LoRA manager's words, and
#: the registry's (srt/lora/lora_manager.py, srt/lora/lora_registry.py).
ALREADY_LOADED = ("because it is already loaded", "already exists")
#: Where SGLang lists its resolved server arguments: the current route, then
#: the one older releases serve (both answer the same).
SERVER_INFO = ("/server_info", "/get_server_info")
#: SGLang's words for refusing LoRA updates with data parallelism above 1.
DP_ASSERT = "data-parallel replicas are not supported for dynamic lora loading"


class SglangDriver(HttpEngine):
    """Drives one SGLang server at ``base_url`` (the server root)."""

    kind = "sglang"
    unload_waits_for_running = True
    """An unload hangs while an in_place pause freezes the adapter's requests."""
    capacity: int | None = None
    """``--max-loaded-loras`` as the server info says (read with the set-up check)."""

    async def pause(self) -> None:
        _expect_ok(await self.send("POST", "/pause_generation", PAUSE_BODY, admin=True))

    async def resume(self) -> None:
        async def call() -> None:
            _expect_ok(await self.send("POST", "/continue_generation", {}, admin=True))

        # A lost resume leaves an engine paused: retry transient failures (the
        # caller's command budget bounds the whole).
        await self.retrying(call, float("inf"))

    async def load_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        body = {"lora_name": name, "lora_path": path}

        async def call() -> None:
            await self._lora_update("/load_lora_adapter", body, name)

        try:
            await self.retrying(call, budget_s)
        except EngineError as exc:
            if not any(words in str(exc) for words in ALREADY_LOADED):
                raise
            root = (await self.served_adapters()).get(name)
            if root != path:
                raise EngineError(
                    f"{exc}; it serves {name!r} from {root!r}, not {path!r}",
                    retryable=False,
                    status=exc.status,
                ) from exc
            log.info("%s already serves %s from %s: loaded", self.base_url, name, path)

    async def unload_adapter(self, name: str) -> None:
        await self._lora_update("/unload_lora_adapter", {"lora_name": name})

    async def list_adapters(self) -> list[str]:
        return sorted(await self.served_adapters())

    async def canary(self, name: str, *, budget_s: float) -> str:
        return await generated(self, "/generate", generate_body(name), generation_of, budget_s)

    async def reset_cache(self, *, budget_s: float) -> None:
        # SGLang flushes only with no request running or waiting (400
        # otherwise), and a pause keeps them: then prefixes computed with the
        # old weights may stay cached. Said in the log, not failed: the new
        # weights did load (docs/engines.md).
        try:
            async with asyncio.timeout(max(budget_s, 0.0)):
                response = await self.request("POST", "/flush_cache", admin=True)
        except (EngineError, TimeoutError) as exc:
            log.warning(
                "%s did not answer a cache flush after a load in place: %s", self.base_url, exc
            )
            return
        if response.status_code >= 400:
            log.warning(
                "%s did not flush its cache after a load in place (%d): %s",
                self.base_url,
                response.status_code,
                response.text[:200],
            )

    async def setup_problem(self) -> str | None:
        """(Also learns :attr:`capacity`, from the same server info.)"""
        size = await self._data_parallel_size()
        if size is None or size <= 1:
            return None
        return (
            f"SGLang at {self.base_url} runs {size} data-parallel replicas (--dp-size {size}) "
            f"and loads no LoRA adapter at run time unless it runs one ({DP_ASSERT!r}): "
            "start it with --dp-size 1 (one SGLang server and one agent per replica)"
        )

    async def _lora_update(
        self, path: str, body: dict[str, str], loaded: str | None = None
    ) -> None:
        """A load or unload; a 500 from an engine that refuses LoRA updates
        for its data parallelism is final, and says so."""
        try:
            response = await self.send("POST", path, body, admin=True)
        except EngineError as exc:
            if exc.status != 500 or not exc.retryable:
                raise
            try:
                problem = await self.setup_problem()
            except EngineError as unread:
                log.debug("%s: no server info after a 500: %s", self.base_url, unread)
                raise exc from None
            if problem is None:
                raise
            raise EngineError(f"{exc}; {problem}", status=exc.status) from exc
        _expect_success(response, loaded)

    async def _data_parallel_size(self) -> int | None:
        """SGLang's ``dp_size`` from its server info (None: not told); and its
        ``max_loaded_loras``, the most adapters it holds at once, as
        :attr:`capacity` (None: not bounded, or not told)."""
        for path in SERVER_INFO:
            response = await self.request("GET", path)
            if route_not_served(response):
                continue
            payload: Any = json_or_none(response) if response.status_code == 200 else None
            info = payload if isinstance(payload, dict) else {}
            self.capacity = _positive_int(info.get("max_loaded_loras"))
            return _positive_int(info.get("dp_size"))
        return None


def generate_body(name: str) -> dict[str, Any]:
    """SGLang's native ``/generate`` for one greedy token with adapter ``name``
    (its OpenAI routes select an adapter by another syntax across releases)."""
    return {
        "text": CANARY_PROMPT,
        "lora_path": name,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _expect_ok(response: EngineAnswer) -> None:
    payload: Any = json_or_none(response)
    if not isinstance(payload, dict) or payload.get("status") != "ok":
        raise EngineError(
            f"{response.method} {response.url} answered "
            f"{response.status_code} {response.text[:200]!r}, not status 'ok'",
            status=response.status_code,
        )


def _expect_success(response: EngineAnswer, loaded: str | None = None) -> None:
    """A LoRA update's answer must say ``success``; a load's must also list the
    name among ``loaded_adapters`` (SGLang may evict others to make room)."""
    payload: Any = json_or_none(response)
    what = f"{response.method} {response.url}"
    if not isinstance(payload, dict) or payload.get("success") is not True:
        # SGLang answers failures with a 400 (raised by send); a 2xx that does
        # not say success is the same failure behind a proxy: classify alike.
        message = error_message(payload, response.text)
        raise EngineError(
            f"{what} answered {response.status_code} without success: {message}",
            retryable=is_transient(response.status_code, message),
            status=response.status_code,
        )
    adapters = payload.get("loaded_adapters")
    if loaded is not None and isinstance(adapters, dict) and loaded not in adapters:
        raise EngineError(
            f"{what} answered success but its loaded adapters do not list {loaded!r}: "
            f"{sorted(adapters)}",
            status=response.status_code,
        )
