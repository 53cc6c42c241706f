"""The fleet's object store of adapters, as the leader sees it: whether the
object a request names is there, before anything of the update runs; and
which objects to delete, decided in one place (:func:`delete_unkept`) from
the records that are the truth, read when it deletes.

Only the orchestrator role writes the store (``lorabus adapter push``), agents
read it (:mod:`lorabus.adapters.fetch`), and only coordinators may purge it:
the leader, which checks it still leads before each deletion. What must
stay, at every moment (the invariant ``lorabus chaos`` checks):

- every adapter's committed version and the versions kept beside it (its
  commit point's ``digest`` and ``kept``; where a reset removed the commit
  point, the reset record's ``kept``, until the adapter's next commit keeps
  them), read from the state bucket;
- the update in flight (its path, and the commit it carries), read from the
  state bucket too;
- every request this leader admitted and has not finished (queued or
  running), and every request it is admitting: from admission's look for
  its object until the request has joined the queue or been refused
  (:meth:`AdapterStore.admitting`). A digest being deleted is refused to
  admission meanwhile, as not stored.

Everything else may go. The versions a commit let go of (its ``dropped``)
are deleted right after it by the leader that wrote it, which knows the
requests queued behind it. A successor that finished the commit from the
update left in flight does not know its predecessor's queue: it leaves them
to its first sweep, by when those requesters have asked it again. A sweep
(a task of the term, alone through ``term.records``, so that no update
writes its commit in the middle of it: at most every ``SWEEP_EVERY_S``, or ``orphan_after_s`` if
shorter, and a term's first one only ``TAKEOVER_GRACE_S`` after it took over
from a predecessor) deletes those, and anything else older than
``orphan_after_s``: pushed and never committed, the chunks of a push that
stopped before its meta, a meta record that is no pushed adapter's. The
records are read once per deletion round (no commit can land meanwhile),
the requests before each deletion. A record or a listing that cannot be
read stops the round: what it names is unknown, and nothing is deleted on a
guess. A round that fails is tried again at the next sweep; it never ends a
term.
"""

from __future__ import annotations

import base64
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping, Set
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client as NatsClient

from lorabus.adapters.bus_paths import check_digest, key_of, object_key, split_key
from lorabus.adapters.store import (
    StoreContents,
    delete_chunks,
    delete_meta,
    delete_object,
    object_size,
    store_contents,
)
from lorabus.coordinator.store import FleetStore
from lorabus.errors import BadRequest, BusError
from lorabus.runtime.clock import now
from lorabus.schemas import CommittedRecord, InflightRecord, KeptVersion, ResetRecord, Subjects

log = logging.getLogger(__name__)

_LOOK_TIMEOUT_S = 5.0
"""The longest admission looks for one request's object: a slow look holds
its own request, and those behind it, no longer."""
SWEEP_EVERY_S = 600.0
"""At most one sweep for orphans this often (or every ``orphan_after_s``)."""
TAKEOVER_GRACE_S = 15.0
"""A term that took over from a predecessor sweeps no sooner: requesters ask
a new leader again within a few seconds (``UpdateClient``'s ``reask_s``),
and only then are the requests its predecessor had queued in its book."""


class AdapterStore:
    """The leader's handle on the object store, and its memory of what
    admission is looking for and what waits for a sweep (for one
    coordinator process)."""

    def __init__(
        self,
        nc: NatsClient,
        subjects: Subjects,
        *,
        orphan_after_s: float = 3600.0,
        clock: Callable[[], float] = now,
        tenants: Iterable[str] = (),
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self.stores = ["", *sorted(tenants)]
        """The fleet's store ("") and each tenant's, by tenant."""
        self._clock = clock
        self.orphan_after_s = orphan_after_s
        self.sweep_every_s = min(orphan_after_s, SWEEP_EVERY_S)
        self._admitting: Counter[str] = Counter()
        """Object keys (``<digest>``, ``<tenant>/<digest>``) of requests
        admission is taking in (:meth:`admitting`), on their way into the
        queue: their objects must not be deleted under them. Every digest
        this class speaks of is such a key."""
        self._deleting: set[str] = set()
        self._next_sweep = clock()
        self.pending: set[str] = set()
        """Digests a commit recovered from a predecessor let go of: for the
        term's first sweep, once its predecessor's requesters asked again."""

    def took_office(self, *, successor: bool) -> None:
        """A new term leads. Its first sweep comes a sweep period from now,
        and, after a predecessor (``successor``), no sooner than
        ``TAKEOVER_GRACE_S``: by then that term's requesters have asked again."""
        grace = max(self.sweep_every_s, TAKEOVER_GRACE_S) if successor else self.sweep_every_s
        self._next_sweep = self._clock() + grace

    def defer(self, dropped: Collection[str]) -> None:
        """What a commit recovered from a predecessor let go of: deleted at
        this term's first sweep, no sooner than ``TAKEOVER_GRACE_S`` from now
        (the predecessor's queue reaches this term as its requesters ask again)."""
        self.pending.update(dropped)
        self._next_sweep = max(self._next_sweep, self._clock() + TAKEOVER_GRACE_S)

    def next_sweep_in(self) -> float:
        """Seconds until the next sweep is due (0: now)."""
        return max(0.0, self._next_sweep - self._clock())

    def sweep_due(self) -> bool:
        """Whether a sweep is due; True marks it done (the next one a sweep
        period later: listing the store costs a read per object)."""
        at = self._clock()
        if at < self._next_sweep:
            return False
        self._next_sweep = at + self.sweep_every_s
        return True

    def being_admitted(self) -> set[str]:
        """The digests of the requests admission is taking in now."""
        return set(self._admitting)

    @contextlib.contextmanager
    def admitting(self, digest: str | None) -> Iterator[None]:
        """While this is held, deletions spare ``digest`` (None: nothing to
        spare): admission holds it for a request from before it looks for its
        object until the request has joined the queue (where the book's held
        paths keep it) or been refused, whatever it awaits meanwhile."""
        if digest is None:
            yield
            return
        self._admitting[digest] += 1
        try:
            yield
        finally:
            self._admitting[digest] -= 1
            if not self._admitting[digest]:
                del self._admitting[digest]

    async def check_stored(self, digest: str) -> None:
        """Raise BadRequest unless the store holds an object under ``digest``,
        looked for under a deadline of its own. Nothing deletes it while this
        looks; from then on the caller holds :meth:`admitting` for it."""
        if digest in self._deleting:
            raise BadRequest(
                f"adapter {digest} is being deleted from the fleet's object store (no "
                "update keeps it): push it again (lorabus adapter push DIR), then ask"
            )
        with self.admitting(digest):
            store, stored = split_key(digest)
            try:
                size = await object_size(
                    self._nc, self._subjects.for_store(store), stored, timeout_s=_LOOK_TIMEOUT_S
                )
            except (TimeoutError, BusError) as exc:
                raise BadRequest(
                    f"could not look for adapter {digest} in the fleet's object store: {exc}"
                ) from exc
        if size is None:
            raise BadRequest(
                f"adapter {digest} is not in the fleet's object store: push it first "
                "(lorabus adapter push DIR)"
            )

    async def delete(self, digest: str) -> bool:
        """Delete the object of ``digest``; False when it was not there. While
        it goes, admission refuses requests for it (see :meth:`check_stored`)."""
        store, stored = split_key(digest)
        self._deleting.add(digest)
        try:
            return await delete_object(self._nc, self._subjects.for_store(store), stored)
        finally:
            self._deleting.discard(digest)

    async def contents(self) -> dict[str, StoreContents]:
        """Every store's contents, by tenant ("": the fleet's). A store that
        cannot be listed (missing, unreadable) is left out, and said: what it
        holds is unknown, so nothing of it is deleted, and the others are
        swept as ever (a tenant's store never stops the fleet's sweep)."""
        found = {}
        for store in self.stores:
            try:
                found[store] = await store_contents(self._nc, self._subjects.for_store(store))
            except (TimeoutError, BusError, nats.errors.Error) as exc:
                log.warning("adapter store %r not listed, not swept this time: %s", store, exc)
        return found

    async def delete_meta(self, store: str, subject: str) -> None:
        await delete_meta(self._nc, self._subjects.for_store(store), subject)

    async def delete_chunks(self, store: str, key: str) -> None:
        await delete_chunks(self._nc, self._subjects.for_store(store), key)


def kept_beside(
    served_name: str,
    path: str,
    previous: CommittedRecord | None,
    reset: ResetRecord | None,
    *,
    keep: int,
) -> tuple[list[KeptVersion], list[str]]:
    """For a new commit of an adapter, served as ``served_name`` from
    ``path``: the earlier versions it keeps beside it, newest first, so that
    with it they are the adapter's ``keep`` newest commits (engines serve
    them all), and the object store digests it lets go of. ``previous``:
    the adapter's commit point before it; where there is none, what its
    ``reset`` kept. A version served under the new one's name (fixed naming:
    reloaded in place) is not kept beside it."""
    earlier: list[KeptVersion] = []
    if previous is not None:
        earlier.append(
            KeptVersion(
                version=previous.version,
                served_name=previous.served_name,
                path=previous.path,
                digest=previous.digest,
            )
        )
        earlier += previous.kept
    elif reset is not None:
        earlier = list(reset.kept)
    unique: list[KeptVersion] = []
    for version in earlier:
        names = {v.served_name for v in unique} | {served_name}
        if version.served_name not in names:
            unique.append(version)
    kept = unique[: max(keep, 1) - 1]
    still = {object_of(v) for v in kept} | {key_of(path)}
    dropped = sorted({d for v in earlier if (d := object_of(v)) is not None} - still)
    return kept, dropped


def object_of(version: KeptVersion) -> str | None:
    """The object key of a kept version (None: from a filesystem). A
    version-6 record names it by ``digest`` alone, in the fleet's store."""
    return key_of(version.path) if version.path else (version.digest or None)


def keepers(
    committed: Mapping[str, CommittedRecord],
    resets: Mapping[str, ResetRecord],
    in_flight: Iterable[InflightRecord] = (),
) -> dict[str, list[str]]:
    """What keeps each digest in the store, by digest: every adapter's
    commit point (its version and those kept beside it; where a reset
    removed it, what the reset kept) and every update in flight. The one rule
    of what must stay, for the deletion and for ``lorabus adapter list``."""
    kept: dict[str, list[str]] = {}

    def keep(digest: str | None, why: str) -> None:
        if digest is not None:
            kept.setdefault(digest, []).append(why)

    for adapter, record in sorted(committed.items()):
        keep(key_of(record.path), f"{adapter} v{record.version} committed")
        for version in record.kept:
            keep(object_of(version), f"{adapter} v{version.version} kept")
    for adapter, reset in sorted(resets.items()):
        if adapter not in committed:
            for version in reset.kept:
                keep(object_of(version), f"{adapter} v{version.version} kept by its reset")
    for update in in_flight:
        keep(key_of(update.path), f"update {update.update_id} in flight")
        if update.committing is not None:
            for digest in keepers({update.adapter: update.committing}, {}):
                keep(digest, f"update {update.update_id} committing")
    return kept


async def kept_by_records(records: FleetStore) -> dict[str, list[str]]:
    """:func:`keepers` of the state bucket's records as they are now.
    StoreUnavailable (CorruptRecord among them) when one cannot be read."""
    committed, resets = await records.read_adapter_records()
    return keepers(committed, resets, await records.read_inflights())


@dataclass(frozen=True)
class Listed:
    """One object of the store, as ``lorabus adapter list`` shows it."""

    digest: str
    size: int
    stored_at: float | None
    kept_by: list[str]
    """Empty: nothing keeps it (deleted once older than the orphan age)."""


def listing(contents: Mapping[str, StoreContents], kept: Mapping[str, list[str]]) -> list[Listed]:
    """Every stored object of every store (by object key) with what keeps
    it; the kept first, oldest first."""
    listed = [
        Listed(key, found.sizes.get(digest, 0), at, list(kept.get(key, [])))
        for store, found in contents.items()
        for digest, at in found.objects.items()
        if (key := object_key(digest, store))
    ]
    return sorted(listed, key=lambda o: (not o.kept_by, o.stored_at or 0.0, o.digest))


async def delete_unkept(
    records: FleetStore,
    objects: AdapterStore,
    *,
    dropped: Collection[str],
    in_use: Callable[[], Set[str]],
    leading: Callable[[], Awaitable[bool]],
    sweep: bool,
    wall_now: float,
) -> list[str]:
    """Delete ``dropped`` (what a commit let go of) and, with ``sweep``, what
    waits for a sweep (``objects.pending``) and what is older than the orphan
    age (the store's time stamps against ``wall_now``, the system clock's):
    each only if no record keeps it (:func:`kept_by_records`) and no request
    ``in_use`` (queued or running) names it or is being admitted for it,
    those asked again right before each deletion, while this term is still
    ``leading`` (asked too). The records are read once: the caller goes
    alone (``term.records.deleting``), so no commit lands meanwhile. The digests deleted (and,
    swept, the leftovers of pushes that stopped)."""
    if not dropped and not sweep:
        return []
    kept = await kept_by_records(records)
    deleted: list[str] = []

    def spared(digest: str) -> bool:
        return digest in kept or digest in in_use() or digest in objects.being_admitted()

    async def may_go(digest: str) -> bool:
        if spared(digest):
            return False
        if not await leading():
            raise BusError("no longer leading: the deletion stops")
        # Asked again: a request may have come for it while that was asked.
        # From here to the deletion's start nothing is awaited.
        return not spared(digest)

    def old(at: float | None) -> bool:
        return at is not None and wall_now - at > objects.orphan_after_s

    for digest in sorted(set(dropped)):
        if await may_go(digest) and await objects.delete(digest):
            deleted.append(digest)
    if not sweep:
        return deleted
    # Listed whole before anything goes: a listing that fails deletes nothing.
    every = await objects.contents()
    stored = {
        object_key(digest, store): at
        for store, contents in every.items()
        for digest, at in contents.objects.items()
    }
    for key in sorted(objects.pending):
        objects.pending.discard(key)
        if key in stored and await may_go(key) and await objects.delete(key):
            deleted.append(key)
    for key, at in sorted(stored.items()):
        if key not in deleted and old(at) and await may_go(key):
            if await objects.delete(key):
                deleted.append(key)
    for store, contents in sorted(every.items()):
        for meta, at in sorted(contents.stray_metas.items()):
            named = _digest_of_meta(meta)
            if old(at) and (named is None or await may_go(object_key(named, store))):
                log.warning("adapter store: removing %s, a meta record of no pushed adapter", meta)
                await objects.delete_meta(store, meta)
                deleted.append(meta)
        for chunks, at in sorted(contents.stray_chunks.items()):
            if old(at) and await leading():
                await objects.delete_chunks(store, chunks)
                deleted.append(f"chunks {store + '/' if store else ''}{chunks}")
    return deleted


def _digest_of_meta(meta: str) -> str | None:
    """The digest a meta subject is named after, if it is one."""
    try:
        name = base64.urlsafe_b64decode(meta.rpartition(".")[2]).decode()
        return check_digest(name)
    except ValueError:
        return None
