"""The direct-HTTP baseline: an update done the orchestrator's own way, from one process.

This is how prime-rl's Dynamo integration updates a LoRA adapter, and what an
orchestrator does without lorabus: one ``httpx.AsyncClient`` per worker, made
once; then per update ``asyncio.gather`` over every worker's pause, over every
worker's load followed by its read-back (``GET /v1/loras``), a poll of the
frontend's ``/v1/models`` until the adapter is listed (from 20 ms, doubling,
as lorabus polls), and, in a ``finally``, every worker's resume. The central
process does all of it, so its CPU time per update is the figure to compare
with the coordinator's.

Run as ``python -m lorabus.testbed.bench.baseline <spec>`` (see ``control.py``);
answers ``update`` with the update's wall time, phases, the process's CPU
seconds and the engines' pause window.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import PurePosixPath
from typing import Any

import httpx

from lorabus.testbed.bench.control import child_main, say, serve_requests

_POLL_FIRST_S = 0.02
_POLL_MAX_S = 1.0


class UpdateFailed(Exception):
    """Raised when a worker or the frontend answers an update call with an error."""


class DirectHttpFleet:
    """The orchestrator's own HTTP clients: one per worker, one for the frontend."""

    def __init__(self, system_urls: dict[str, str], frontend_url: str, timeout_s: float) -> None:
        timeout = httpx.Timeout(timeout_s)
        self.clients = {
            wid: httpx.AsyncClient(base_url=url, timeout=timeout)
            for wid, url in system_urls.items()
        }
        self.frontend = httpx.AsyncClient(base_url=frontend_url, timeout=timeout)
        self.verify_timeout_s = timeout_s

    async def aclose(self) -> None:
        await asyncio.gather(self.frontend.aclose(), *(c.aclose() for c in self.clients.values()))

    async def update(self, name: str, path: str) -> dict[str, Any]:
        phases: dict[str, float] = {}
        cpu_started = time.process_time()
        started = time.perf_counter()
        first_pause = time.time()
        resumed: list[Any] = []
        try:
            await self._each(phases, "pause", _pause)
            body = {"lora_name": name, "source": {"uri": PurePosixPath(path).as_uri()}}
            await self._each(phases, "load", lambda c: _load_and_read_back(c, body))
            mark = time.perf_counter()
            await self._wait_listed(name)
            phases["verify"] = time.perf_counter() - mark
        finally:
            mark = time.perf_counter()
            resumed = await asyncio.gather(
                *(_resume(c) for c in self.clients.values()), return_exceptions=True
            )
            phases["resume"] = time.perf_counter() - mark
        failed = [r for r in resumed if isinstance(r, BaseException)]
        if failed:
            raise UpdateFailed(f"{len(failed)} resumes failed, e.g. {failed[0]!r}")
        return {
            "wall_s": time.perf_counter() - started,
            "cpu_s": time.process_time() - cpu_started,
            "phases": phases,
            "first_pause": first_pause,
            "last_resume": max(resumed),
        }

    async def _each(self, phases: dict[str, float], phase: str, call: Any) -> None:
        mark = time.perf_counter()
        await asyncio.gather(*(call(c) for c in self.clients.values()))
        phases[phase] = time.perf_counter() - mark

    async def _wait_listed(self, name: str) -> None:
        deadline = time.monotonic() + self.verify_timeout_s
        pause = _POLL_FIRST_S
        while True:
            response = await self.frontend.get("/v1/models")
            response.raise_for_status()
            if any(model.get("id") == name for model in response.json().get("data", [])):
                return
            if time.monotonic() + pause > deadline:
                raise UpdateFailed(f"the frontend did not list {name!r} in time")
            await asyncio.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)


def _checked(response: httpx.Response) -> dict[str, Any]:
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    if body.get("status") == "error":
        raise UpdateFailed(f"{response.request.url} answered an error: {body}")
    return body


async def _pause(client: httpx.AsyncClient) -> None:
    _checked(
        await client.post("/engine/pause_generation", json={"mode": "keep", "clear_cache": False})
    )


async def _load_and_read_back(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
    _checked(await client.post("/v1/loras", json=body))
    loras = _checked(await client.get("/v1/loras")).get("loras", {})
    if body["lora_name"] not in loras:
        raise UpdateFailed(f"{client.base_url} does not list {body['lora_name']!r}")


async def _resume(client: httpx.AsyncClient) -> float:
    _checked(await client.post("/engine/resume_generation", json={}))
    return time.time()


async def serve(spec: dict[str, Any]) -> None:
    cpu_started, started = time.process_time(), time.perf_counter()
    fleet = DirectHttpFleet(spec["workers"], spec["frontend_url"], spec["timeout_s"])
    try:
        say(
            {
                "ready": True,
                "setup_s": time.perf_counter() - started,
                "setup_cpu_s": time.process_time() - cpu_started,
            }
        )

        async def handle(request: dict[str, Any]) -> dict[str, Any]:
            if request["op"] != "update":
                raise ValueError(f"unknown request {request['op']!r}")
            try:
                return {"ok": True, **await fleet.update(request["name"], request["path"])}
            except (UpdateFailed, httpx.HTTPError) as exc:
                return {"ok": False, "message": f"{type(exc).__name__}: {exc}"}

        await serve_requests(handle)
    finally:
        await fleet.aclose()


if __name__ == "__main__":
    child_main(serve)
