"""Driver for an NVIDIA Dynamo worker's system server (docs/engines.md).

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
HTTP clients and servers resolve them away (``DELETE /v1/loras/..`` is
``DELETE /v1``).

Retries and error classification are shared with the other engines'
drivers (:mod:`lorabus.agents.http_engine`): only transient failures (no
answer, a 5xx, a 408/429, an older release's status-200 error body) are
retried; a 4xx or an answer that says the directory holds no adapter fails
the call at once.

The canary (:mod:`lorabus.agents.canary`): a Dynamo worker serves no
generation of its own, so the agent asks the frontend (``--frontend-url``)
for one greedy token of ``POST /v1/completions`` with
``"nvext": {"backend_instance_id": <id>, "extra_fields": ["worker_id"]}``,
which Dynamo 1.6.1's KV router routes to this worker only (its round-robin
router ignores the id: the answer's ``nvext.worker_id`` then names another
worker, and the canary fails, saying to run ``--router-mode kv``). The id
is the worker's ``instance_id`` in the frontend's ``/v1/rl/workers`` (its
RL port, ``--frontend-discovery-url``), found by this worker's
``system_url`` and looked up again when a canary fails (a restarted worker
registers under a new id). In disaggregated serving a prefill worker's
canary names it as ``prefill_worker_id`` and a decode worker's as
``decode_worker_id``: each is proven in the phase it serves.

Pause asks for ``keep`` mode (in-flight requests are held, then continue).
Dynamo 1.6.1's vLLM backend refuses ``keep`` while requests for a LoRA
adapter are in flight; the driver then pauses in ``wait`` mode, which lets
those requests finish first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from lorabus.agents.canary import completion_of, generated
from lorabus.agents.config import ENGINE_TIMEOUT_S
from lorabus.agents.http_engine import (
    EngineAnswer,
    HttpEngine,
    error_message,
    is_transient,
    json_or_none,
    url_segment,
)
from lorabus.canary import completion_body
from lorabus.errors import CanaryFailed, EngineError
from lorabus.runtime.clock import now
from lorabus.schemas import WorkerRole

log = logging.getLogger(__name__)

PAUSE_BODY = {"mode": "keep", "clear_cache": False}
PAUSE_WAIT_BODY = {"mode": "wait", "clear_cache": False}
#: How Dynamo's vLLM handler refuses a keep-mode pause (dynamo/vllm/handlers.py).
KEEP_REFUSED = "Cannot pause generation in keep mode with active LoRA requests"


class DynamoDriver(HttpEngine):
    """Drives one Dynamo worker through its system server at ``system_url``."""

    kind = "dynamo"

    def __init__(
        self,
        system_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        admin_headers: Mapping[str, str] | None = None,
        timeout_s: float = ENGINE_TIMEOUT_S,
        attempts: int = 5,
        frontend_url: str = "",
        discovery_url: str = "",
        role: WorkerRole = WorkerRole.AGGREGATED,
    ) -> None:
        """``frontend_url``: the frontend the canary generates through (none:
        the canary fails, saying so); ``discovery_url``: where it serves
        ``/v1/rl/workers`` (its RL port; default ``frontend_url``)."""
        super().__init__(
            system_url,
            headers=headers,
            admin_headers=admin_headers,
            timeout_s=timeout_s,
            attempts=attempts,
        )
        self._frontend = (
            HttpEngine(frontend_url, headers=headers, timeout_s=timeout_s, attempts=attempts)
            if frontend_url
            else None
        )
        self._discovery = (
            HttpEngine(discovery_url, headers=headers, timeout_s=timeout_s, attempts=attempts)
            if discovery_url and frontend_url
            else self._frontend
        )
        self._instance_id: int | None = None
        """This worker's instance id, as the frontend's discovery last said."""
        self.role = role
        """A prefill worker's canary is routed to it for the prefill, a decode
        worker's for the decode (disaggregated serving), else for both."""

    async def aclose(self) -> None:
        await super().aclose()
        for client in {id(c): c for c in (self._frontend, self._discovery) if c}.values():
            await client.aclose()

    @property
    def system_url(self) -> str:
        return self.base_url

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
        await self.retrying(
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
        # found no adapter in is final, and so is a 4xx (see is_transient).
        await self.retrying(lambda: self._call("POST", "/v1/loras", body), budget_s)

    async def unload_adapter(self, name: str) -> None:
        await self._call("DELETE", f"/v1/loras/{url_segment(name)}")

    async def list_adapters(self) -> list[str]:
        body = await self._call("GET", "/v1/loras")
        loras = body.get("loras")
        if not isinstance(loras, dict):  # no JSON object with a map of loras: not Dynamo's answer
            raise EngineError(f"GET /v1/loras answered an unexpected body: {body!r}")
        return sorted(loras)

    async def canary(self, name: str, *, budget_s: float) -> str:
        if self._frontend is None:
            raise CanaryFailed(
                f"the agent of Dynamo worker {self.system_url} has no --frontend-url: a "
                "Dynamo worker generates only through its frontend (give the agent "
                "--frontend-url, or turn the canary off for the fleet: lorabus "
                "coordinator --no-canary)"
            )
        started = now()
        known = self._instance_id is not None
        try:
            return await self._routed_canary(name, budget_s)
        except CanaryFailed:
            if not known:
                raise
            # A worker that restarted registers under a new instance id: look
            # it up again, once, before taking the failure as the adapter's.
            return await self._routed_canary(name, budget_s - (now() - started))

    async def _routed_canary(self, name: str, budget_s: float) -> str:
        """The canary, routed to this worker by its instance id (looked up
        when not known); any failure forgets the id, so that the next canary
        looks it up again."""
        assert self._frontend is not None
        started = now()
        try:
            if self._instance_id is None:
                self._instance_id = await self._find_instance_id(budget_s)
            body = completion_body(name) | {"nvext": _routed_to(self._instance_id, self.role)}
            read = self._served_here(completion_of(name))
            left_s = budget_s - (now() - started)
            return await generated(self._frontend, "/v1/completions", body, read, left_s)
        except BaseException:
            self._instance_id = None
            raise

    def _served_here(self, read: Callable[[EngineAnswer], str]) -> Callable[[EngineAnswer], str]:
        """``read``, and the frontend must say which worker answered
        (``nvext.worker_id``, asked for), and that it is this one: a router
        that does not route by instance id (Dynamo 1.6.1's round-robin)
        answers from any worker that holds the name, which proves nothing
        of this one."""
        phase = "prefill" if self.role == WorkerRole.PREFILL else "decode"

        def checked(answer: EngineAnswer) -> str:
            text = read(answer)
            payload = json_or_none(answer)
            nvext = payload.get("nvext") if isinstance(payload, dict) else None
            served = nvext.get("worker_id") if isinstance(nvext, dict) else None
            worker = served.get(f"{phase}_worker_id") if isinstance(served, dict) else None
            if type(worker) is not int:
                raise CanaryFailed(
                    f"the frontend did not say which worker answered the canary's {phase} "
                    "(nvext.worker_id, asked for with extra_fields): it proves nothing of "
                    "this worker (a proxy that drops nvext? a Dynamo release without it?)"
                )
            if worker != self._instance_id:
                raise CanaryFailed(
                    f"the frontend answered the canary's {phase} from worker {worker}, not "
                    f"this one ({self._instance_id}): its router does not route by instance "
                    "id; run the frontend with --router-mode kv (Dynamo 1.6.1 routes "
                    "nvext.backend_instance_id there), or turn the canary off "
                    "(lorabus coordinator --no-canary)"
                )
            return text

        return checked

    async def _find_instance_id(self, budget_s: float) -> int:
        """This worker's instance id, from the frontend's RL discovery: the
        entry whose ``system_url`` is this worker's, else the one entry with
        its port and path (an agent may reach its worker by another host name
        than the one it advertises: ``localhost``, a container's name)."""
        assert self._discovery is not None
        discovery = self._discovery
        answers: list[EngineAnswer] = []

        async def ask() -> None:
            answers.append(await discovery.send("GET", "/v1/rl/workers"))

        await discovery.retrying(ask, budget_s)
        response = answers[-1]
        payload = json_or_none(response)
        listed = payload.get("workers") if isinstance(payload, dict) else None
        entries = [
            (entry["system_url"].rstrip("/"), entry["instance_id"])
            for entry in (listed if isinstance(listed, list) else [])
            if isinstance(entry, dict)
            and isinstance(entry.get("system_url"), str)
            and type(entry.get("instance_id")) is int
        ]
        mine = self.system_url.rstrip("/")
        found = {i for url, i in entries if url == mine} or {
            i for url, i in entries if _port_and_path(url) == _port_and_path(mine)
        }
        if len(found) == 1:
            return found.pop()
        what = "lists no worker" if not found else f"lists {len(found)} workers"
        raise CanaryFailed(
            f"the frontend's discovery at {response.url} {what} with this worker's system "
            f"URL {mine} (or its port and path): give --system-url as the worker "
            "advertises it"
        )

    async def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        response = await self.send(method, path, body)
        payload = json_or_none(response)
        if isinstance(payload, dict) and payload.get("status") == "error":
            # Engine routes report every failure this way, and older releases
            # a failed load too (the same failure as a later 500: retry alike).
            message = error_message(payload, response.text)
            status = response.status_code
            raise EngineError(
                f"{method} {self.system_url}{path} answered {status} with an error: {message}",
                retryable=is_transient(status, message),
                status=status,
            )
        return payload if isinstance(payload, dict) else {}


def _routed_to(instance: int, role: WorkerRole) -> dict[str, object]:
    """Route to worker ``instance`` alone in its ``role`` (a prefill worker
    for the prefill, a decode worker for the decode, else for both), and say
    in the answer who served it."""
    key = {
        WorkerRole.PREFILL: "prefill_worker_id",
        WorkerRole.DECODE: "decode_worker_id",
    }.get(role, "backend_instance_id")
    return {key: instance, "extra_fields": ["worker_id"]}


def _port_and_path(url: str) -> tuple[int | None, str]:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return port or (443 if parts.scheme == "https" else 80), parts.path
