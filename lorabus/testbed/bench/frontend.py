"""A frontend for the null-engine runs: ``/v1/models`` lists what it is told.

With null engines no simulated worker loads anything, so the simulated
frontend would never list the adapter. This one lists the served name that
the bench is about to request, so the coordinator's verify step still makes
its real HTTP poll (and, as against a real frontend right after the loads,
finds the adapter at the first poll). Many adapters updated at once (the
tenants series) are each announced under their adapter's name, and each
adapter's newest announcement stays listed. A completion of a listed model
is answered at once (the canary phase's request through the frontend).
"""

from __future__ import annotations

from types import TracebackType

from aiohttp import web


class ListingFrontend:
    def __init__(self) -> None:
        self.base_model = "sim-base"
        self.models: list[str] = []
        self.newest: dict[str, str] = {}
        """Adapter -> its served name announced last (:meth:`announce_for`)."""
        self._runner: web.AppRunner | None = None
        self.url = ""

    def announce(self, model: str) -> None:
        """List ``model`` from now on (with the last few announced before it)."""
        self.models = [*self.models[-3:], model]

    def announce_for(self, adapter: str, model: str) -> None:
        """List ``model`` from now on in place of ``adapter``'s name announced before."""
        self.newest[adapter] = model

    async def _models(self, request: web.Request) -> web.Response:
        names = [self.base_model, *self.models, *self.newest.values()]
        data = [{"id": m, "object": "model", "owned_by": "nvidia"} for m in names]
        return web.json_response({"object": "list", "data": data})

    async def _completions(self, request: web.Request) -> web.Response:
        """The canary through the frontend: a completion of any model listed."""
        model = (await request.json()).get("model")
        if model not in (self.base_model, *self.models, *self.newest.values()):
            return web.json_response({"message": "Model not found", "code": 404}, status=404)
        choice = {"index": 0, "text": " Paris", "finish_reason": "length"}
        return web.json_response({"object": "text_completion", "model": model, "choices": [choice]})

    async def __aenter__(self) -> ListingFrontend:
        app = web.Application()
        app.add_routes(
            [web.get("/v1/models", self._models), web.post("/v1/completions", self._completions)]
        )
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
