"""The fleet's object store of adapters, as the leader sees it: whether the
object a request names is there, before anything of the update runs; and
which objects to delete once no adapter keeps them.

Only the orchestrator role writes it (``lorabus adapter push``) and agents
read it (:mod:`lorabus.adapter_objects`); the leader looks, so that an
update naming a digest nobody pushed is refused at once, with nothing
paused and no member asked to fetch it. Each adapter keeps the objects of
its ``keep`` newest commits, as engines keep its loaded versions; the
record of them (``stored`` in the state bucket) is the leader's alone. An
object pushed but never committed (its update failed, or none asked for
it) goes at a later commit from the store, once it is older than the
coordinator's ``orphan_after_s`` and no request named it since (looked at
once every ``SWEEP_EVERY_S`` at most).
"""

from __future__ import annotations

from collections.abc import Callable, Set

from nats.aio.client import Client as NatsClient

from lorabus.adapter_objects import delete_object, digest_of, object_size, stored_objects
from lorabus.clock import now
from lorabus.coordinator.store import FleetStore
from lorabus.errors import BadRequest, BusError
from lorabus.schemas import CommittedRecord, StoredAdaptersRecord, StoredVersion, Subjects

_LOOK_TIMEOUT_S = 5.0
SWEEP_EVERY_S = 600.0
"""At most one sweep for orphans this often (or every ``orphan_after_s``)."""


class AdapterStore:
    def __init__(
        self, nc: NatsClient, subjects: Subjects, clock: Callable[[], float] = now
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self._clock = clock
        self._asked: dict[str, float] = {}
        """Digests requests named, when last: admitted while a sweep lists
        the store, a request's object must not be swept under it."""
        self._swept_at: float | None = None

    def asked_lately(self, within_s: float) -> set[str]:
        """The digests requests named in the last ``within_s`` seconds."""
        at = self._clock()
        self._asked = {d: t for d, t in self._asked.items() if at - t <= within_s}
        return set(self._asked)

    def sweep_due(self, every_s: float) -> bool:
        """Whether a sweep for orphans is due (at most one every ``every_s``:
        listing the store costs a read per object); True marks it done."""
        at = self._clock()
        if self._swept_at is not None and at - self._swept_at < every_s:
            return False
        self._swept_at = at
        return True

    async def check_stored(self, digest: str) -> None:
        """Raise BadRequest unless the store holds an object under ``digest``."""
        self._asked[digest] = self._clock()
        try:
            size = await object_size(self._nc, self._subjects, digest, timeout_s=_LOOK_TIMEOUT_S)
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
        """Delete the object of ``digest``; False when it was not there."""
        return await delete_object(self._nc, self._subjects, digest)

    async def stored(self) -> dict[str, float]:
        """Every digest stored, with when it was stored (seconds since the epoch)."""
        return await stored_objects(self._nc, self._subjects)


async def retire_stored(
    term_store: FleetStore,
    objects: AdapterStore,
    committed: CommittedRecord,
    *,
    keep: int,
    waiting: Set[str],
    orphan_after_s: float,
    wall_now: float,
) -> list[str]:
    """After a commit from the object store: record it as the newest version
    of its adapter the store keeps, and delete the objects no adapter keeps
    any more (the ``keep`` newest commits of each, the committed one always
    among them) and those never committed (see :func:`sweep_orphans`); the
    digests deleted. A commit from a filesystem path changes nothing."""
    digest = digest_of(committed.path)
    if digest is None:
        return []
    record = await term_store.read_stored()
    kept_before = record.adapters.get(committed.adapter, [])
    versions = [StoredVersion(version=committed.version, digest=digest)]
    versions += [v for v in kept_before if v.digest != digest]
    kept, dropped = versions[: max(keep, 1)], versions[max(keep, 1) :]
    adapters = record.adapters | {committed.adapter: kept}
    await term_store.write_stored(StoredAdaptersRecord(adapters=adapters))
    still_kept = {v.digest for vs in adapters.values() for v in vs}
    deleted = []
    for gone in sorted({v.digest for v in dropped} - still_kept):
        if await objects.delete(gone):
            deleted.append(gone)
    if objects.sweep_due(min(orphan_after_s, SWEEP_EVERY_S)):
        spared = still_kept | waiting | objects.asked_lately(orphan_after_s)
        deleted += await sweep_orphans(
            objects, spared, orphan_after_s=orphan_after_s, wall_now=wall_now
        )
    return deleted


async def sweep_orphans(
    objects: AdapterStore, spared: Set[str], *, orphan_after_s: float, wall_now: float
) -> list[str]:
    """Delete every stored object that ``spared`` (the kept versions and what
    requests named lately or wait with) does not name and that was stored more than
    ``orphan_after_s`` before ``wall_now`` (the system clock's: the store's
    time stamps are the server's): younger ones may be for a request not
    asked yet (a trainer pushes, then asks). The digests deleted."""
    deleted = []
    for digest, stored_at in sorted((await objects.stored()).items()):
        if digest not in spared and wall_now - stored_at > orphan_after_s:
            if await objects.delete(digest):
                deleted.append(digest)
    return deleted
