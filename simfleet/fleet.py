"""A whole simulated fleet behind one aiohttp server on one port.

:class:`SimFleet` owns the workers' state and the server's lifecycle. The
frontend answers at the root, each worker's system server under
``/workers/{id}`` and the simulator's control API under ``/sim``; one port and
one process hold a thousand workers. Each worker plays one engine kind
(Dynamo by default; vLLM or SGLang with ``engines``), and a fleet may mix
them: the frontend lists the union of every worker's adapters whatever its
kind, as a router in front of a mixed fleet would. Each worker also has a
role (``roles``: aggregated by default, or Dynamo's disaggregated prefill and
decode workers).

Stopping first releases every request held by a ``hang``, a latency or a pause
(they answer 503), so the server's graceful shutdown does not wait on them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from aiohttp import web

from .control_routes import ControlRoutes
from .frontend_routes import PAUSED_WAIT_S, FrontendRoutes
from .identity import numbered_worker_ids
from .state import SimWorker, WorkerFaults
from .worker_routes import WorkerRoutes

__all__ = ["SimFleet"]

log = logging.getLogger(__name__)

_MAX_BACKLOG = 8192
"""The kernel caps it at ``net.core.somaxconn`` anyway."""

#: Grace period for in-flight requests once the fleet stops.
_SHUTDOWN_GRACE_S = 5.0


class SimFleet:
    """Simulated workers (Dynamo, vLLM or SGLang) plus frontend, served over real HTTP."""

    def __init__(
        self,
        worker_ids: Sequence[str],
        world_sizes: Sequence[int],
        *,
        api_key: str | None = None,
        base_model: str = "sim-base",
        load_latency_s: float = 0.0,
        paused_wait_s: float = PAUSED_WAIT_S,
        engines: Sequence[str] = ("dynamo",),
        roles: Sequence[str] = ("aggregated",),
    ):
        """``engines`` and ``roles`` (``ROLES``: a prefill worker makes the
        frontend disaggregate) are cycled over the workers, like world sizes
        in :meth:`of_size`."""
        ids, sizes = list(worker_ids), list(world_sizes)
        if not engines:
            raise ValueError("engines must not be empty")
        if not roles:
            raise ValueError("roles must not be empty")
        if len(ids) != len(sizes):
            raise ValueError(f"{len(ids)} worker ids but {len(sizes)} world sizes")
        duplicates = sorted(i for i, count in Counter(ids).items() if count > 1)
        if duplicates:
            raise ValueError(f"duplicate worker ids: {duplicates}")
        load_latency = {"load": load_latency_s} if load_latency_s else {}
        self.workers: dict[str, SimWorker] = {
            worker_id: SimWorker(
                worker_id,
                size,
                faults=WorkerFaults(latency_s=dict(load_latency)),
                engine=engines[i % len(engines)],
                base_model=base_model,
                role=roles[i % len(roles)],
            )
            for i, (worker_id, size) in enumerate(zip(ids, sizes, strict=True))
        }
        self.api_key = api_key
        self.base_model = base_model
        self._paused_wait_s = paused_wait_s
        self._runner: web.AppRunner | None = None
        self._url: str | None = None
        self._stopped = False

    @classmethod
    def of_size(cls, n: int, world_sizes: Sequence[int] = (1,), **kw: Any) -> SimFleet:
        """``n`` workers ``w000``.. with world sizes cycling through ``world_sizes``."""
        if not world_sizes:
            raise ValueError("world_sizes must not be empty")
        sizes = [world_sizes[i % len(world_sizes)] for i in range(n)]
        return cls(numbered_worker_ids(n), sizes, **kw)

    @property
    def url(self) -> str:
        """Base URL of the frontend, e.g. ``http://127.0.0.1:PORT``."""
        if self._url is None:
            raise RuntimeError("the simulated fleet is not started")
        return self._url

    def system_url(self, worker_id: str) -> str:
        """Base URL of a worker's system server."""
        return f"{self.url}/workers/{worker_id}"

    def _build_app(self) -> web.Application:
        app = web.Application()
        app.add_routes(WorkerRoutes(self.workers, api_key=self.api_key).routes())
        frontend = FrontendRoutes(
            self.workers,
            api_key=self.api_key,
            base_model=self.base_model,
            system_url=self.system_url,
            paused_wait_s=self._paused_wait_s,
        )
        app.add_routes(frontend.routes())
        app.add_routes(ControlRoutes(self.workers).routes())
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Bind and serve; ``port=0`` picks a free port (see :attr:`url`)."""
        if self._runner is not None or self._stopped:
            raise RuntimeError("a simulated fleet can be started only once")
        runner = web.AppRunner(
            self._build_app(), access_log=None, shutdown_timeout=_SHUTDOWN_GRACE_S
        )
        await runner.setup()
        try:
            # One process stands in for every engine of the fleet: thousands
            # of agents connect at once (aiohttp's default backlog, 128,
            # made the kernel reset most of 4096).
            backlog = max(128, min(len(self.workers), _MAX_BACKLOG))
            await web.TCPSite(runner, host, port, backlog=backlog).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        bound_port = runner.addresses[0][1]
        url_host = f"[{host}]" if ":" in host else host
        self._url = f"http://{url_host}:{bound_port}"
        log.info("simulated fleet of %d workers serving at %s", len(self.workers), self._url)

    async def stop(self) -> None:
        """Release held requests and shut the server down; safe to call twice."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._stopped = True
        for worker in self.workers.values():
            worker.release()
        await runner.cleanup()
        log.info("simulated fleet at %s stopped", self._url)

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
