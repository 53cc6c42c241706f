"""This node's copies of adapters from the fleet's object store, by digest.

An engine loads an adapter from a directory on its own host, so an agent
given a bus path fetches the adapter into a cache directory first and hands
the engine ``<directory>/<hex>``: a directory that holds exactly the files
whose adapter digest is ``sha256:<hex>``. Agents of one node share the
directory (several processes), so each digest is fetched once: whoever holds
the digest's lock (``flock`` on ``.locks/<hex>.lock``) fetches, and the others
wait for the lock and then find the entry there.

Nothing is served unverified. An entry is hashed again on use (a file changed
on disk is found, removed and fetched again), unless an agent of this node
hashed it, or fetched it, in the last ten minutes, since the node last
booted, and none of its files changed since (same names, sizes, inodes and
modification times, recorded next to its lock: a few ``stat`` calls instead
of reading gigabytes), so an update's prepare and load hash it once per
node, not once per agent and step. A fetched adapter is hashed before it
gets its name, and a half-written one never has it: the fetch unpacks the
object as its chunks arrive (no archive file) into a folder under
``.partial/``, hashing it on the way, and one ``rename`` names it. The files are
not synced to disk first: what the kernel had not written back is lost only
with the node (a crash or a power cut), and after a reboot no note holds,
so the entry is hashed before it is used, and fetched again if it lost
anything.

:meth:`AdapterCache.prune` never removes an entry an engine of the node may
serve, whichever agent of whichever fleet sharing the directory prunes, and
across restarts: each agent names what its engine holds in a holder file
under ``.holders/``, and a prune leaves every digest a fresh one names,
read again under the entry's lock just before the entry goes
(:mod:`~lorabus.agents.cache_holders`). Of the other entries it keeps the
``keep`` most recently used. It runs in the background, never inside a
command (:class:`~lorabus.agents.cache_holders.CacheKeeper`), and takes
entries vanishing while it looks (another agent's prune) in its stride.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Protocol

from lorabus.adapters.archive import BadArchive, Unpacker
from lorabus.adapters.bus_paths import check_digest
from lorabus.adapters.digest import adapter_digest, adapter_files
from lorabus.adapters.fetch import ChunkSink
from lorabus.agents.cache_holders import HolderFiles
from lorabus.errors import DigestMismatch, FetchFailed

__all__ = ["AdapterCache", "Fetch", "StoreFetch"]

log = logging.getLogger(__name__)

Fetch = Callable[[str, ChunkSink], Awaitable[int]]


class StoreFetch(Protocol):
    """Writes the adapter ``digest`` of ``store`` ("": the fleet's, else a
    tenant's) into ``into``; its size (the agent's ``AgentBus.fetch_adapter``)."""

    def __call__(self, digest: str, into: ChunkSink, *, store: str = "") -> Awaitable[int]: ...


"""Writes the object store's adapter of a digest, chunk by chunk, into a
sink (the cache's :class:`~lorabus.adapters.archive.Unpacker`); returns its
size. The agent's connection gives one (``AgentBus.fetch_adapter``)."""

_ENTRY = re.compile(r"^[0-9a-f]{64}$")
_LOCK_POLL_S = (0.002, 0.02)
"""First and longest pause between tries of a lock another process holds."""
_TRUST_HASH_S = 600.0
"""How long after an agent of the node hashed an entry (fetched, or checked)
its files, unchanged, are taken as checked: the update's prepare and its load
on every agent of the node hash it once, not once per agent and step; any
later use hashes it again."""
_PARTIAL_MAX_AGE_S = 300.0
"""A leftover under ``.partial/`` older than this, with its digest unlocked, is
what a process that died left there (a fetch's unpacked folder, an entry
taken out to be deleted, a holder file being written): prune removes it."""


class _Lock:
    """An exclusive ``flock`` on one digest's lock file, for every process of the node.

    ``flock`` locks belong to an open file, so two holders in one process
    exclude each other too. prune deletes lock files it holds: a lock taken on
    a file no longer at its path guards nothing, and is let go at once."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                self._fd, fd = fd, -1
                return True
        except (BlockingIOError, FileNotFoundError):
            pass
        finally:
            if fd >= 0:
                os.close(fd)
        return False

    async def acquire(self) -> None:
        pause = _LOCK_POLL_S[0]
        while not self.try_acquire():
            await asyncio.sleep(pause)
            pause = min(pause * 2, _LOCK_POLL_S[1])

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self, *, remove: bool = False) -> None:
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self._fd)
        self._fd = -1


class AdapterCache:
    def __init__(self, directory: str, *, keep: int = 2) -> None:
        """``keep``: entries kept by :meth:`prune` besides those held."""
        self.directory = os.path.abspath(directory)
        self.keep = keep
        self._locks = os.path.join(self.directory, ".locks")
        self._partial = os.path.join(self.directory, ".partial")
        self.holders = HolderFiles(os.path.join(self.directory, ".holders"), self._partial)
        """What the engines of the node serve from this cache, an agent each."""
        self.unremovable: set[str] = set()
        """Entries the last prunes could not remove (each said once)."""

    def check_writable(self) -> None:
        """Create the cache's directories and write in each; OSError, naming the
        directory, when that cannot be done (the agent is not ready then)."""
        for folder in (self.directory, self._locks, self._partial, self.holders.directory):
            try:
                os.makedirs(folder, exist_ok=True)
                with tempfile.TemporaryFile(dir=folder):
                    pass
            except OSError as exc:
                raise OSError(
                    exc.errno, f"adapter cache {folder!r} cannot be written: {exc.strerror or exc}"
                ) from exc

    async def get(self, digest: str, fetch: Fetch, *, timeout_s: float, source: str = "") -> str:
        """The directory of the adapter ``digest``, fetched with ``fetch`` when this
        node has no good copy. FetchFailed when it cannot be had in ``timeout_s``
        (or ``fetch`` fails), DigestMismatch when the fetched files are others.

        ``source``: the object (``<tenant>/<digest>``) the caller must hold
        these bytes from. A copy the node holds from another source is used
        only once ``fetch`` has brought them from this one too, checked
        against the digest: else a tenant that writes a meta record naming
        another's digest into its own store would be served the other's
        adapter from the node's cache, without ever having its bytes."""
        hex_digest = check_digest(digest).removeprefix("sha256:")
        entry = os.path.join(self.directory, hex_digest)
        deadline = asyncio.timeout(timeout_s)
        try:
            async with deadline:
                for folder in (self._locks, self._partial):
                    os.makedirs(folder, exist_ok=True)
                lock = _Lock(os.path.join(self._locks, f"{hex_digest}.lock"))
                await lock.acquire()
                try:
                    if not await self._holds(entry, digest):
                        await self._fetch(entry, digest, fetch)
                    elif source and source not in self._sources(entry):
                        await self._fetch(entry, digest, fetch, into_place=False)
                    if source:
                        self._note_source(entry, source)
                    os.utime(entry)  # its last use, for prune
                    return entry
                finally:
                    lock.release()
        except TimeoutError as exc:
            if not deadline.expired():
                raise
            raise FetchFailed(
                f"adapter {digest} was not in this node's cache within {timeout_s:g}s"
            ) from exc
        except OSError as exc:  # the node's disk: full, or not ours to write
            raise FetchFailed(
                f"adapter {digest}: the cache {self.directory!r} cannot keep it: {exc}"
            ) from exc

    async def _holds(self, entry: str, digest: str) -> bool:
        """Whether ``entry`` holds exactly ``digest``; one that does not is removed."""
        if await asyncio.to_thread(self._hashed_lately, entry):
            return True
        found = await asyncio.to_thread(_digest_at, entry)
        if found == digest:
            await asyncio.to_thread(self._note_hashed, entry)
        if found is None or found == digest:
            return found is not None
        log.warning(
            "adapter cache: %s does not hold %s (%s): fetching it again", entry, digest, found
        )
        await asyncio.to_thread(self._discard, entry)
        return False

    async def _fetch(
        self, entry: str, digest: str, fetch: Fetch, *, into_place: bool = True
    ) -> None:
        """Fetch ``digest``, unpacked and hashed as its chunks are written (no
        archive file, no second read), and rename it into place if it is
        ``digest`` (``into_place`` False: only check that it is, the node
        holding it already). A chunk that cannot be the archive stops the fetch."""
        tag = os.path.basename(entry) + "."  # prune's sweep tells whose leftover it is
        unpacked = tempfile.mkdtemp(prefix=tag, dir=self._partial)
        os.chmod(unpacked, 0o755)  # an engine may run as another user
        unpacker = Unpacker(unpacked)
        try:
            try:
                await fetch(digest, unpacker)
                found = unpacker.finish() or await asyncio.to_thread(adapter_digest, unpacked)
            except BadArchive as exc:
                raise FetchFailed(
                    f"adapter {digest}: the store's object is no adapter: {exc}"
                ) from exc
            except FetchFailed:
                raise
            except Exception as exc:
                raise FetchFailed(f"adapter {digest}: the fetch failed: {exc!r}") from exc
            if found != digest:
                raise DigestMismatch(
                    f"adapter {digest} was asked for; the store's object holds {found}"
                )
            if into_place:
                os.rename(unpacked, entry)
                await asyncio.to_thread(self._note_hashed, entry)
        finally:
            # In one thread: a write still under way there (the fetch was
            # cancelled) ends before the folder goes, and a second cancel
            # while this waits still leaves nothing open or behind.
            await asyncio.to_thread(_close_and_remove, unpacker, unpacked)

    def _discard(self, path: str) -> None:
        """Take ``path`` out of the cache at once (one rename), then delete it."""
        shutil.rmtree(self._take_out(path), ignore_errors=True)

    def _take_out(self, path: str) -> str:
        """Take ``path`` out of the cache (one rename); returns the folder under
        ``.partial/`` that now holds it, to delete."""
        for note in (self._hash_note(path), self._sources_note(path)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(note)
        trash = tempfile.mkdtemp(prefix=os.path.basename(path) + ".", dir=self._partial)
        try:
            os.rename(path, os.path.join(trash, "old"))
        except OSError:
            os.rmdir(trash)
            raise
        return trash

    def _hash_note(self, entry: str) -> str:
        return os.path.join(self._locks, os.path.basename(entry) + ".hashed")

    def _sources_note(self, entry: str) -> str:
        return os.path.join(self._locks, os.path.basename(entry) + ".sources")

    def _sources(self, entry: str) -> set[str]:
        """The objects (``<tenant>/<digest>``) ``entry``'s bytes were fetched
        from and checked, under the entry's lock (:meth:`get`)."""
        try:
            with open(self._sources_note(entry)) as note:
                return set(note.read().split())
        except FileNotFoundError:
            return set()

    def _note_source(self, entry: str, source: str) -> None:
        if source not in self._sources(entry):
            with open(self._sources_note(entry), "a") as note:
                note.write(source + "\n")

    def _note_hashed(self, entry: str) -> None:
        """Record, for every agent of the node, that ``entry`` was just hashed
        and found right, with what its files looked like then."""
        note = {"at": time.time(), "boot": _boot_id(), "files": _fingerprint(entry)}
        path = self._hash_note(entry)
        with tempfile.NamedTemporaryFile("w", dir=self._locks, delete=False) as file:
            json.dump(note, file)
        os.replace(file.name, path)

    def _hashed_lately(self, entry: str) -> bool:
        """Whether an agent of this node hashed ``entry`` less than
        ``_TRUST_HASH_S`` ago and none of its files changed since."""
        try:
            with open(self._hash_note(entry)) as file:
                note = json.load(file)
            fresh = 0 <= time.time() - float(note["at"]) < _TRUST_HASH_S
            fresh = fresh and note["boot"] == _boot_id()
            files = note["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        now_files = _fingerprint(entry)
        return fresh and now_files is not None and [list(f) for f in now_files] == files

    def prune(self, protect: Collection[str] = ()) -> list[str]:
        """Remove the entries beyond the ``keep`` most recently used ones, except
        those held (``protect``, and the digests a fresh holder file names) and
        those another process uses now, and old leftovers of fetches; returns
        the digests removed. An entry that vanishes while it looks (another
        agent's prune) is skipped; one it may not remove is left for the next
        prune; ValueError when a holder file cannot be read (then it removes
        nothing). Blocking: call it from a thread."""
        if not os.path.isdir(self.directory):
            return []
        protected = {check_digest(d) for d in protect}
        entries = []
        for item in os.scandir(self.directory):
            if _ENTRY.match(item.name):
                with contextlib.suppress(FileNotFoundError):  # taken meanwhile
                    entries.append((item.stat(follow_symlinks=False).st_mtime_ns, item.name))
        held = self._held(protected)
        unheld = sorted(((used, name) for used, name in entries if name not in held), reverse=True)
        removed = []
        for used, name in unheld[self.keep :]:
            entry = os.path.join(self.directory, name)
            lock = _Lock(os.path.join(self._locks, f"{name}.lock"))
            if not (os.path.isdir(self._locks) and lock.try_acquire()):
                continue  # in use now: a get is checking or fetching it
            trash = ""
            try:
                # Read again under the lock: a load names its digest before its
                # get takes this lock, so either this sees it, or that get
                # finds the entry gone and fetches it again.
                if name not in self._held(protected) and os.lstat(entry).st_mtime_ns == used:
                    trash = self._take_out(entry)  # else used since we looked
                    removed.append(f"sha256:{name}")
                self.unremovable.discard(name)
            except FileNotFoundError:
                pass  # another process's prune took it
            except OSError as exc:  # not ours to remove: the next prune tries again
                if name not in self.unremovable:
                    self.unremovable.add(name)
                    log.warning("adapter cache: cannot remove %s: %s", entry, exc)
            finally:
                lock.release(remove=True)
            if trash:  # out of the cache already: deleted without holding its lock
                shutil.rmtree(trash, ignore_errors=True)
        self._sweep_partial()
        return removed

    def _held(self, protect: set[str]) -> set[str]:
        """The hex digests of ``protect`` and of every fresh holder file."""
        return {d.removeprefix("sha256:") for d in protect | self.holders.held()}

    def _sweep_partial(self) -> None:
        """Remove what processes that died left under ``.partial/`` (see
        ``_PARTIAL_MAX_AGE_S``)."""
        if not (os.path.isdir(self._partial) and os.path.isdir(self._locks)):
            return
        old = time.time() - _PARTIAL_MAX_AGE_S
        for item in os.scandir(self._partial):
            lock = _Lock(os.path.join(self._locks, f"{item.name[:64]}.lock"))
            with contextlib.suppress(FileNotFoundError):  # another prune was quicker
                if item.stat(follow_symlinks=False).st_mtime > old:
                    continue
                if _ENTRY.match(item.name[:64]) and not lock.try_acquire():
                    continue  # a fetch of that digest is under way (a slow one)
                try:
                    if item.is_dir(follow_symlinks=False):
                        shutil.rmtree(item.path, ignore_errors=True)
                    else:
                        os.unlink(item.path)
                finally:
                    if lock.held:
                        lock.release()


_Fingerprint = tuple[tuple[str, int, int, int], ...]


def _fingerprint(entry: str) -> _Fingerprint | None:
    """Each file the digest of ``entry`` covers (:func:`adapter_files`) as
    (relative path, size, inode, modification time); None when it cannot be
    read (then it is hashed, and found out)."""
    try:
        return tuple(
            (relative, s.st_size, s.st_ino, s.st_mtime_ns)
            for relative, path in adapter_files(entry)
            for s in (path.stat(),)
        )
    except (OSError, ValueError):
        return None


def _digest_at(entry: str) -> str | None:
    """The digest of the entry at ``entry`` (None: there is none), else what is wrong."""
    if not os.path.lexists(entry):
        return None
    if os.path.islink(entry) or not os.path.isdir(entry):
        return "not a directory"
    try:
        return adapter_digest(entry)
    except (OSError, ValueError) as exc:
        return f"unreadable: {exc}"


def _boot_id() -> str:
    """This boot of the node (Linux): a note written before a reboot may
    describe files whose last writes the reboot lost. "" where the kernel
    does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            return file.read().strip()
    except OSError:
        return ""


def _close_and_remove(unpacker: Unpacker, folder: str) -> None:
    unpacker.close()
    shutil.rmtree(folder, ignore_errors=True)
