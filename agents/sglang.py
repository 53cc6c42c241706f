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
- With ``--api-key`` (or ``--admin-api-key`` for the control routes), 401
  ``{"error": "Unauthorized"}`` without the bearer token.

Pause uses ``in_place``: the scheduler stops stepping and keeps running
requests and their KV cache where they are, continuing them after
``/continue_generation``; ``abort`` (SGLang's default) would fail them and
``retract`` would move them back to the queue and recompute their KV cache.
A new adapter name does not touch the adapters running requests use.

Since SGLang answers every refusal with a 400, its load errors are final
(:mod:`lorabus.agents.http_engine`); no answer, a 5xx (a proxy, a crashed
handler), 408 or 429 are retried within the load's budget. A load of a name
SGLang already holds is read back as the vLLM driver does: done when that
name was loaded from the same path, a final error when from another.
Names travel only in JSON bodies, never in URLs.
"""

from __future__ import annotations

import logging
from typing import Any

from lorabus.agents.http_engine import (
    EngineAnswer,
    HttpEngine,
    error_message,
    is_transient,
    json_or_none,
)
from lorabus.errors import EngineError

__all__ = ["SglangDriver"]

log = logging.getLogger(__name__)

PAUSE_BODY = {"mode": "in_place"}
#: How SGLang refuses a load of a name it holds: the LoRA manager's words, and
#: the registry's (srt/lora/lora_manager.py, srt/lora/lora_registry.py).
ALREADY_LOADED = ("because it is already loaded", "already exists")


class SglangDriver(HttpEngine):
    """Drives one SGLang server at ``base_url`` (the server root)."""

    kind = "sglang"

    async def pause(self) -> None:
        _expect_ok(await self.send("POST", "/pause_generation", PAUSE_BODY))

    async def resume(self) -> None:
        async def call() -> None:
            _expect_ok(await self.send("POST", "/continue_generation", {}))

        # A lost resume leaves an engine paused: retry transient failures (the
        # caller's command budget bounds the whole).
        await self.retrying(call, float("inf"))

    async def load_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        body = {"lora_name": name, "lora_path": path}

        async def call() -> None:
            _expect_success(await self.send("POST", "/load_lora_adapter", body), name)

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
        _expect_success(await self.send("POST", "/unload_lora_adapter", {"lora_name": name}))

    async def list_adapters(self) -> list[str]:
        return sorted(await self.served_adapters())


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
