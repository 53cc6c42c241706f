"""One agent's loads of adapters from the fleet's object stores, through the node's cache.

A load whose path is a bus path (``bus:sha256:<hex>``, ``bus:<tenant>/...``:
:mod:`lorabus.adapters.bus_paths`) is not read from this host's disk: the
adapter is fetched into this node's cache
(:class:`~lorabus.agents.adapter_cache.AdapterCache`, verified against its
digest before it is handed out, whichever store it came from) and the engine
is handed the cached directory. A ``prepare`` does the fetch alone, ahead of
the update's pause, so that the load under the pause finds it there.

The cache is shared by the node's agents and pruned beside them, and an
engine may read an adapter from its directory again long after the load
(vLLM does). So :class:`StoreLoads` keeps the record of what this agent's
engine may serve from the cache, and which digests a load to come needs, and
tells its :class:`~lorabus.agents.cache_holders.CacheKeeper` before every
fetch and whenever the executor asks: no prune on the node removes those.
The engine's load itself is the executor's; this module never calls the
engine.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from functools import partial

from lorabus.adapters.bus_paths import digest_of, object_key, store_of
from lorabus.agents.adapter_cache import AdapterCache, StoreFetch
from lorabus.agents.cache_holders import CacheKeeper
from lorabus.errors import BadRequest, FetchFailed

PREPARED_KEPT = 16
"""Prepared digests held for their loads to come: as many updates as a
coordinator runs at once by default (``--max-concurrent``)."""


class StoreLoads:
    """Fetches adapters from the object stores into the node's cache for one
    agent, and holds the cache entries its engine serves or a load needs."""

    def __init__(
        self,
        worker_id: str,
        adapter_cache: AdapterCache | None,
        cache_keeper: CacheKeeper | None = None,
    ) -> None:
        """``cache_keeper``: prunes ``adapter_cache`` for this agent (by default
        one without a holder file: what the engine serves is kept from the
        prunes of this process only)."""
        self.worker_id = worker_id
        self.adapter_cache = adapter_cache
        """This node's adapters from the fleet's object store (None: the agent
        takes filesystem paths only)."""
        self.fetch: StoreFetch | None = None
        """Reads the fleet's object stores: the agent's connection sets it."""
        if cache_keeper is None and adapter_cache is not None:
            cache_keeper = CacheKeeper(adapter_cache)
        self.cache_keeper = cache_keeper
        """Says what the engine holds from the cache, and prunes it (the agent
        runs it)."""
        self._serves: dict[str, set[str]] = {}
        """Served name -> digests of the cache the engine may serve under it
        (a predecessor's record at first: its engine serves on)."""
        self._prepared: dict[str, None] = {}
        """Digests fetched for a load to come, oldest first: those of the last
        ``PREPARED_KEPT`` prepares (updates of different adapters prepare at
        once; one whose load never comes is let go after as many more)."""
        self._loading = ""
        """The name a load from the cache is loading now."""
        if cache_keeper is not None:
            self._serves, prepared = cache_keeper.held_here()
            self._prepared = dict.fromkeys(sorted(prepared))

    def stored(self, path: str) -> tuple[str, str | None]:
        """The store ("": the fleet's, else a tenant's) and the digest a bus
        path names; the digest None for a path on a filesystem."""
        try:
            return store_of(path), digest_of(path)
        except ValueError as exc:
            raise BadRequest(f"{self.worker_id} refused the load: {exc}") from exc

    def prepared(self, digest: str, listed: Collection[str] | None) -> None:
        """Hold ``digest`` for the load a prepare announces (before it is
        fetched), letting the oldest prepares go past ``PREPARED_KEPT``.
        ``listed``: what the engine lists, as for :meth:`hold`."""
        self._prepared.pop(digest, None)
        self._prepared[digest] = None  # newest last
        for oldest in list(self._prepared)[:-PREPARED_KEPT]:
            del self._prepared[oldest]
        self.hold(listed)

    @contextmanager
    def loading(self, name: str, digest: str, listed: Collection[str] | None) -> Iterator[None]:
        """Hold ``digest`` for a load of it as ``name`` while the block fetches
        and loads it; once the block is done, the name serves that digest alone
        (a failed load leaves both held, until the engine's list says which it
        serves). ``listed``: what the engine lists, as for :meth:`hold`."""
        # Held before the fetch, beside what the name may serve now (a load in
        # place): no prune on the node takes the entry from under the load.
        self._serves.setdefault(name, set()).add(digest)
        self._loading = name
        self.hold(listed)
        try:
            yield
        finally:
            self._loading = ""
        self._serves[name] = {digest}
        self._prepared.pop(digest, None)

    async def fetched(self, store: str, digest: str, budget_s: float) -> str:
        """The cached directory of ``digest``, fetched from ``store`` first if
        this node lacks it (the cache checks the bytes against the digest,
        whichever store they came from)."""
        if self.adapter_cache is None or self.fetch is None:
            raise FetchFailed(
                f"{self.worker_id} has no adapter cache: it cannot take {digest} "
                "from the fleet's object store"
            )
        return await self.adapter_cache.get(
            digest,
            partial(self.fetch, store=store),
            timeout_s=budget_s,
            # A tenant's object: its bytes must have come from its own store.
            source=object_key(digest, store) if store else "",
        )

    def hold(self, listed: Collection[str] | None) -> None:
        """Tell the cache keeper what the engine may serve from the cache and
        what a load to come needs. ``listed``: the engine's adapter list (None:
        not read yet); names it lacks are let go once it is known (a restarted
        agent holds its predecessor's record until then). Never fails a
        command."""
        if self.cache_keeper is None:
            return
        if listed is not None:
            kept = set(listed) | {self._loading}
            self._serves = {n: d for n, d in self._serves.items() if n in kept}
        self.cache_keeper.hold(self._serves, list(self._prepared))
