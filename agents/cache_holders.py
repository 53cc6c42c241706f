"""What the engines of one node serve from its adapter cache, and pruning around it.

An engine loads an adapter from a directory of the node's cache, and may read
it there again later: vLLM does, after evicting the adapter from its CPU
cache. So no prune may remove an entry an engine still serves. The cache
directory is shared by every agent of the node, and with ``--cache-dir`` by
several fleets, and an agent restarts while its engine serves on: what an
engine serves cannot live in one agent process's memory. Each agent keeps it
in a holder file of its own, ``.holders/<fleet>.<worker>.json`` in the cache
directory::

    {"serves": {"policy-v3": ["sha256:..."]}, "prepared": ["sha256:..."], "pid": 4242}

``serves``: each served name the engine may hold from the cache, with the
digests it may serve under it (two while a name is loaded again in place);
``prepared``: digests fetched for a load to come. A file is written whole,
then renamed over the old one (``os.replace``), so a reader sees the old or
the new record, never half of one; it is not synced to disk: a crash of the
node that loses it restarts the engines too.

A holder file outlives its agent: the next agent of that worker takes it for
its own until it has read what its engine lists. A live agent rewrites it
every :data:`PRUNE_EVERY_S`; one not rewritten for :data:`HOLDER_MAX_AGE_S`
(a day) is of an agent gone for good, or stopped for a day while its engine
may still serve: what it names is no longer kept for it. Such a file is
ignored, never deleted (its agent may be rewriting it at that moment): an
operator removes it at will.

Pruning is housekeeping, and never part of a command: an update's load must
not fail because an entry of another agent vanished mid-scan or a removal
was slow. Each agent's :class:`CacheKeeper` prunes in the background (a
task of the agent's): at its start, soon after what its engine holds
changed, and every :data:`PRUNE_EVERY_S`; a prune or a holder write that
fails is logged when it starts failing and when it works again, counted
(``lorabus_adapter_cache_errors_total``), and tried again later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Protocol

from lorabus.adapters.bus_paths import check_digest

if TYPE_CHECKING:
    from lorabus.agents.adapter_cache import AdapterCache

__all__ = [
    "HOLDER_MAX_AGE_S",
    "PRUNE_EVERY_S",
    "PRUNE_RETRY_S",
    "CacheCounts",
    "CacheKeeper",
    "HolderFiles",
    "Holding",
]

log = logging.getLogger(__name__)

HOLDER_MAX_AGE_S = 86400.0
"""A holder file not rewritten for this long no longer holds anything. Long:
an engine may serve on while its agent is down, and a day of disk is cheap
beside an adapter lost under a serving engine."""
PRUNE_EVERY_S = 600.0
"""How often a :class:`CacheKeeper` prunes, and rewrites its holder file,
when nothing asked for it sooner."""
PRUNE_RETRY_S = 60.0
"""How soon a prune that failed is tried again."""

Holding = dict[str, object]
"""One agent's record: ``{"serves": {name: [digest, ...]}, "prepared": [digest, ...]}``."""


def holding(serves: Mapping[str, Collection[str]], prepared: Collection[str]) -> Holding:
    """The record of what an engine ``serves`` and the ``prepared`` digests, in
    one canonical form (records compare equal when they say the same)."""
    return {
        "serves": {name: sorted(set(digests)) for name, digests in sorted(serves.items())},
        "prepared": sorted(set(prepared)),
    }


def digests_named(record: object) -> set[str]:
    """The digests a holder's record names; ValueError when it is no such record."""
    if not isinstance(record, dict):
        raise ValueError("not a holder's record")
    serves, prepared = record.get("serves"), record.get("prepared")
    if not (isinstance(serves, dict) and isinstance(prepared, list)):
        raise ValueError("not a holder's record")
    named = [*prepared, *(d for digests in serves.values() for d in digests)]
    if not all(isinstance(digest, str) for digest in named):
        raise ValueError("not a holder's record")
    return {check_digest(digest) for digest in named}


class HolderFiles:
    """The ``.holders/`` folder of a cache directory: one file per agent."""

    def __init__(self, directory: str, scratch: str) -> None:
        """``scratch``: a folder on the same filesystem for files being written
        (the cache's ``.partial/``, whose sweep removes what a crash left)."""
        self.directory = directory
        self._scratch = scratch

    def path(self, holder: str) -> str:
        return os.path.join(self.directory, f"{holder}.json")

    def write(self, holder: str, record: Holding) -> None:
        """Replace ``holder``'s file with ``record`` (OSError when it cannot be)."""
        for folder in (self.directory, self._scratch):
            os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=self._scratch, prefix="holder.", delete=False
        ) as f:
            json.dump({**record, "pid": os.getpid()}, f)
        try:
            os.replace(f.name, self.path(holder))
        except OSError:
            os.unlink(f.name)
            raise

    def read(self, holder: str) -> tuple[dict[str, set[str]], set[str]]:
        """What ``holder``'s file says: served name -> digests, and the prepared
        digests. FileNotFoundError without a file, ValueError for another one."""
        with open(self.path(holder)) as file:
            record = json.load(file)
        digests_named(record)  # checks its shape
        serves = {str(name): set(digests) for name, digests in record["serves"].items()}
        return serves, set(record["prepared"])

    def held(self) -> set[str]:
        """Every digest a holder file rewritten in the last ``HOLDER_MAX_AGE_S``
        names. ValueError when one of those cannot be read: then nobody knows
        what its engine serves, and a prune must remove nothing."""
        try:
            items = list(os.scandir(self.directory))
        except FileNotFoundError:
            return set()
        oldest = time.time() - HOLDER_MAX_AGE_S
        held: set[str] = set()
        for item in items:
            if not item.name.endswith(".json"):
                continue
            try:
                if item.stat().st_mtime < oldest:
                    continue
                with open(item.path) as file:
                    held |= digests_named(json.load(file))
            except FileNotFoundError:
                continue  # deleted by an operator meanwhile
            except ValueError as exc:
                raise ValueError(f"holder file {item.path} cannot be read: {exc}") from exc
        return held


class CacheCounts(Protocol):
    """Where a :class:`CacheKeeper` counts its housekeeping (the agent's metrics)."""

    def cache_pruned(self, removed: int) -> None: ...

    def cache_failed(self, operation: str) -> None: ...


class CacheKeeper:
    """One agent's part in keeping the node's cache: it says what its engine
    may serve from it (its holder file), and prunes it in the background."""

    def __init__(
        self, cache: AdapterCache, *, holder: str = "", counts: CacheCounts | None = None
    ) -> None:
        """``holder``: the name of this agent's holder file, ``<fleet>.<worker>``
        ("": what it holds stays in this process's memory, for its own prunes
        only). ``counts``: where prunes and failures are counted."""
        if holder.startswith(".") or "/" in holder or "\0" in holder:
            raise ValueError(f"adapter cache holder {holder!r} is no file name")
        self.cache = cache
        self.holder = holder
        self._counts = counts
        self._holding: Holding | None = None
        """What this agent last said it holds (None: nothing yet)."""
        self._written: Holding | None = None
        """What its holder file says, as this process last wrote it."""
        self._prune_due = asyncio.Event()
        self._prune_due.set()  # at the start: a restarted agent tidies up
        self._where = f"adapter cache {cache.directory} ({holder or 'this process'})"
        """How its log lines name the cache and the agent."""
        self._hold_trouble = _Trouble(f"{self._where}: writing the holder file")
        self._prune_trouble = _Trouble(f"{self._where}: pruning")

    def hold(self, serves: Mapping[str, Collection[str]], prepared: Collection[str] = ()) -> None:
        """Say what this agent's engine may serve from the cache (served name ->
        digests: a name loaded again may serve the old bytes until it is) and
        which digests a load to come needs (``prepared``): no prune of the
        node removes those. Written when it changed, before the entries are
        fetched or used; a write that fails is logged, counted and tried
        again at the next call or prune. Never raises: housekeeping."""
        record = holding(serves, prepared)
        if record != self._holding:
            self._holding = record
            self._prune_due.set()  # what it let go may go now
        if record != self._written:
            self._write()

    def held_here(self) -> tuple[dict[str, set[str]], set[str]]:
        """What this agent's holder file says (a predecessor's, at a restart):
        served name -> digests, and the prepared digests; nothing when there is
        no file or it cannot be read."""
        if not self.holder:
            return {}, set()
        try:
            return self.cache.holders.read(self.holder)
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("%s: ignoring its unreadable holder file: %s", self._where, exc)
        return {}, set()

    def _write(self) -> None:
        record = self._holding
        if not self.holder or record is None:
            return
        try:
            self.cache.holders.write(self.holder, record)
        except Exception as exc:  # housekeeping: never a command's failure
            self._hold_trouble.failed(exc)
            if self._counts is not None:
                self._counts.cache_failed("hold")
            return
        self._hold_trouble.worked()
        self._written = record

    async def run(self, *, every_s: float = PRUNE_EVERY_S, retry_s: float = PRUNE_RETRY_S) -> None:
        """Prune the cache until cancelled, in a thread: at once, when
        :meth:`hold` changed what is held, and every ``every_s`` (rewriting
        the holder file, so it stays fresh); ``retry_s`` after a prune or a
        holder write failed. Raises nothing but a cancellation."""
        wait_s = every_s
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._prune_due.wait()
            self._prune_due.clear()
            if self._holding is not None:
                self._write()  # still here: the file stays fresh
            pruned = await self._prune()
            failing = not pruned or self._hold_trouble.failing
            wait_s = min(retry_s, every_s) if failing else every_s

    async def _prune(self) -> bool:
        """One prune, in a thread; whether it worked."""
        mine = digests_named(self._holding) if self._holding is not None else set()
        stuck = set(self.cache.unremovable)
        try:
            removed = await asyncio.to_thread(self.cache.prune, mine)
        except Exception as exc:
            self._prune_trouble.failed(exc)
            if self._counts is not None:
                self._counts.cache_failed("prune")
            return False
        self._prune_trouble.worked()
        if removed:
            log.info("%s: removed %s", self._where, ", ".join(removed))
        if self._counts is not None:
            self._counts.cache_pruned(len(removed))
            for _ in self.cache.unremovable - stuck:  # logged by the prune, once each
                self._counts.cache_failed("remove")
        return True


class _Trouble:
    """A housekeeping operation that may fail again and again: logged when it
    starts failing and when it works again, not at every try."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failing = False

    def failed(self, exc: Exception) -> None:
        if self.failing:
            log.debug("%s failed again: %r", self.what, exc)
            return
        self.failing = True
        log.warning("%s failed, to be tried again: %r", self.what, exc)

    def worked(self) -> None:
        if self.failing:
            self.failing = False
            log.info("%s works again", self.what)
