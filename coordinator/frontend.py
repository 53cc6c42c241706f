"""The coordinator's view of the Dynamo frontend: which models it lists, and
whether a model answers a generation through it (the canary phase).

``/v1/models`` is a union over workers, so a listing proves that some worker
published the adapter, not that all did; the per-worker read-backs in the load
acks are what prove every replica has it. Polling starts at tens of
milliseconds because a listing usually appears right after the load.

Updates of different adapters verify at once, and a frontend's listing is
one request whatever it is asked for: every poll joins the listing request
under way, if there is one, instead of sending its own (T tenants' verifies
cost one stream of requests, not T; with 32 at once, separate polls queued
for the client's connections until they timed out). A poll that joins a
request sent before its adapter was loaded simply polls again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    retry_if_result,
    stop_after_delay,
    wait_exponential,
)

from lorabus.canary import completion_body, read_completion
from lorabus.errors import CanaryFailed, FrontendUnverified
from lorabus.runtime.clock import now

log = logging.getLogger(__name__)


class FrontendClient:
    def __init__(
        self, base_url: str, *, headers: Mapping[str, str] | None = None, timeout_s: float = 10.0
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=dict(headers or {}), timeout=httpx.Timeout(timeout_s)
        )
        self._listing: asyncio.Task[set[str]] | None = None
        """The listing request under way, which every poll joins."""

    async def aclose(self) -> None:
        if self._listing is not None:
            self._listing.cancel()
            await asyncio.gather(self._listing, return_exceptions=True)
        await self._http.aclose()

    async def shared_listing(self) -> set[str]:
        """The models listed, from the listing request under way or a new one.
        A poll cancelled while it waits leaves the request to the others."""
        if self._listing is None or self._listing.done():
            self._listing = asyncio.create_task(self.list_models())
        return await asyncio.shield(self._listing)

    async def list_models(self) -> set[str]:
        response = await self._http.get("/v1/models")
        response.raise_for_status()
        return {entry["id"] for entry in response.json().get("data", []) if "id" in entry}

    async def generate(self, model: str, timeout_s: float) -> str:
        """One greedy token from ``model``, routed as any client's request is
        (the canary phase); CanaryFailed unless answered as ``model``. No
        answer or a 5xx is asked again within ``timeout_s``."""
        url = f"{self.base_url}/v1/completions"

        async def ask() -> str:
            try:
                response = await self._http.post(
                    "/v1/completions", json=completion_body(model), timeout=timeout_s
                )
            except httpx.HTTPError as exc:
                raise CanaryFailed(f"POST {url} failed: {type(exc).__name__}: {exc}") from exc
            return read_completion(response.status_code, response.content, f"POST {url}", model)

        retrying = AsyncRetrying(
            stop=stop_after_delay(timeout_s),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            retry=retry_if_exception(_may_answer_later),
            reraise=True,
        )
        try:
            return await retrying(ask)
        except CanaryFailed as exc:
            raise CanaryFailed(
                f"the frontend did not answer a generation as {model!r}: {exc}"
            ) from exc

    async def wait_listed(self, model: str, timeout_s: float) -> float:
        """Poll until ``model`` is listed; return seconds taken or raise FrontendUnverified."""
        started = now()
        last_problem = "never listed"

        async def listed() -> bool:
            nonlocal last_problem
            try:
                models = await self.shared_listing()
            except (httpx.HTTPError, ValueError) as exc:
                last_problem = f"last poll failed: {type(exc).__name__}: {exc}"
                return False
            if model in models:
                return True
            last_problem = f"last listing: {sorted(models)[:20]}"
            return False

        retrying = AsyncRetrying(
            stop=stop_after_delay(timeout_s),
            wait=wait_exponential(multiplier=0.02, min=0.02, max=1.0),
            retry=retry_if_result(lambda ok: not ok),
            retry_error_callback=lambda _state: False,
        )
        if not await retrying(listed):
            raise FrontendUnverified(
                f"frontend {self.base_url} did not list {model!r} within {timeout_s:.1f}s "
                f"({last_problem})"
            )
        return now() - started


def _may_answer_later(exc: BaseException) -> bool:
    """No answer, or a 5xx (a worker restarting, a proxy): asked again."""
    return isinstance(exc, CanaryFailed) and (exc.status is None or exc.status >= 500)
