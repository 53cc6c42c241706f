"""Control routes under ``/sim``: inspect workers and inject faults over HTTP.

Tests that drive a simulated fleet in another process (the demo, benchmarks,
``lorabus sim``) cannot touch :class:`SimWorker` objects, so these routes expose
the same knobs. They are the simulator's own API, not Dynamo's, and need no
bearer token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
from aiohttp import web

from .http_utils import error_reply
from .state import SimWorker

__all__ = ["ControlRoutes", "worker_state"]


class _FaultsPatch(msgspec.Struct, forbid_unknown_fields=True):
    """Any subset of :class:`WorkerFaults` fields."""

    latency_s: dict[str, float] | msgspec.UnsetType = msgspec.UNSET
    fail_next_loads: int | msgspec.UnsetType = msgspec.UNSET
    load_failure_status: int | msgspec.UnsetType = msgspec.UNSET
    fail_next_unloads: int | msgspec.UnsetType = msgspec.UNSET
    hang: bool | msgspec.UnsetType = msgspec.UNSET
    status_error_quirk: bool | msgspec.UnsetType = msgspec.UNSET
    busy_loras: list[str] | msgspec.UnsetType = msgspec.UNSET
    unroutable: list[str] | msgspec.UnsetType = msgspec.UNSET
    load_misses_ranks: list[int] | msgspec.UnsetType = msgspec.UNSET


_PATCH_DECODER = msgspec.json.Decoder(_FaultsPatch)

_WorkerRoute = Callable[[web.Request, SimWorker], Awaitable[web.Response]]
_Route = Callable[[web.Request], Awaitable[web.Response]]


def worker_state(worker: SimWorker) -> dict[str, Any]:
    """The JSON view of a worker that the control routes answer."""
    return {
        "worker_id": worker.worker_id,
        "instance_id": worker.instance_id,
        "world_size": worker.world_size,
        "engine": worker.engine,
        "role": worker.role,
        "paused": worker.paused,
        "adapters": sorted(worker.adapters),
        "faults": dataclasses.asdict(worker.faults),
    }


class ControlRoutes:
    """Route table of the simulator's control API."""

    def __init__(self, workers: Mapping[str, SimWorker]):
        self._workers = workers

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/sim/workers", self._list),
            web.get("/sim/workers/{worker_id}", self._for_worker(_state)),
            web.put("/sim/workers/{worker_id}/faults", self._for_worker(_set_faults)),
            web.get("/sim/workers/{worker_id}/requests", self._for_worker(_requests)),
        ]

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response([worker_state(w) for w in self._workers.values()])

    def _for_worker(self, handler: _WorkerRoute) -> _Route:
        async def handle(request: web.Request) -> web.Response:
            worker = self._workers.get(request.match_info["worker_id"])
            if worker is None:
                return error_reply(404, "unknown worker")
            return await handler(request, worker)

        return handle


async def _state(request: web.Request, worker: SimWorker) -> web.Response:
    return web.json_response(worker_state(worker))


async def _set_faults(request: web.Request, worker: SimWorker) -> web.Response:
    try:
        patch = _PATCH_DECODER.decode(await request.read())
        changes = {
            name: value
            for name in patch.__struct_fields__
            if (value := getattr(patch, name)) is not msgspec.UNSET
        }
        worker.set_faults(**changes)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        return error_reply(400, f"invalid faults: {exc}")
    return web.json_response(worker_state(worker))


async def _requests(request: web.Request, worker: SimWorker) -> web.Response:
    return web.json_response([dataclasses.asdict(r) for r in worker.requests])
