"""The engine-driver interface: what an agent needs from its inference engine.

Agents talk to engines only through this interface, one implementation per
engine kind, so the command logic never sees an engine's paths or payloads.
A driver that can tell whether its engine was started able to take LoRA
updates at all also implements :class:`SetupCheck`; one whose engine swaps
an adapter's weights under the same name, keeping the old ones when the new
ones fail to load, implements :class:`InPlaceReplace`; one whose engine
caches prefixes per adapter name, with a route to drop them, implements
:class:`CacheReset`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class EngineDriver(Protocol):
    kind: str
    """Engine kind announced in heartbeats, e.g. ``dynamo``."""

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def load_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        """Load ``path`` under ``name``; retry transient failures within ``budget_s``.

        ``path`` is absolute and, when the agent has adapter roots, already
        resolved and checked on this host: load it as given.
        """
        ...

    async def unload_adapter(self, name: str) -> None:
        """Unload ``name``. Names reach the driver checked, but a driver that puts
        one in a URL still encodes it as a single segment (``/`` included)."""
        ...

    async def list_adapters(self) -> list[str]: ...

    async def canary(self, name: str, *, budget_s: float) -> str:
        """Generate one greedy token with the adapter served as ``name`` and
        return the text; CanaryFailed when the engine does not answer it as
        that name (retrying transient failures within ``budget_s``)."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class SetupCheck(Protocol):
    async def setup_problem(self) -> str | None:
        """What keeps the engine from taking LoRA updates however often asked,
        and how to fix it (None: nothing known), found without changing
        anything. Raises EngineError when the engine does not answer."""
        ...


@runtime_checkable
class CacheReset(Protocol):
    async def reset_cache(self, *, budget_s: float) -> None:
        """Drop what the engine cached from earlier requests (its prefix
        cache), so that nothing computed with a name's old weights serves
        the new ones loaded under the same name (retrying transient
        failures within ``budget_s``)."""
        ...


@runtime_checkable
class InPlaceReplace(Protocol):
    async def replace_adapter(self, name: str, path: str, *, budget_s: float) -> None:
        """Load ``path`` over ``name``, which the engine serves, in one call:
        when the new weights fail to load, the old ones keep serving (where
        an unload, then a load, would leave the name unserved)."""
        ...
