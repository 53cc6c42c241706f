"""The coordinator's durable state, in JetStream KV; the second of its bus modules.

What a successor must find when the active coordinator dies lives here: the
leader record (holder and epoch), the committed adapter (per adapter and the
latest, which agents read to converge), each adapter's latest reset (its
lineage), the update in flight (sent ahead of
the commands of its pause and its load), and every result by update id (kept a day, so a requester
retrying an id after a failover still gets the outcome).

Every call has a deadline; a failure raises :class:`StoreUnavailable` and the
caller decides whether it can go on without the write. A record that does not
decode raises :class:`CorruptRecord`, a StoreUnavailable that also says which
key and revision hold it: unreadable is not absent (a caller that acted on
"none" could withdraw a commit), yet a caller that knows what is safe to write
over it can (the leader record by compare-and-set on that revision).
Three helpers say how a caller goes on: :func:`until_stored` tries again,
:func:`quietly` and :func:`or_none` go on without.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from lorabus.coordinator.config import StorageConfig
from lorabus.coordinator.signals import LostRace, StoreUnavailable
from lorabus.coordinator.streams import make_tenant_stores, provision
from lorabus.runtime.cancellation import raise_if_cancelled
from lorabus.runtime.clock import now
from lorabus.schemas import (
    CommittedRecord,
    InflightRecord,
    LeaderRecord,
    Reader,
    ResetRecord,
    Subjects,
    UpdateResult,
)
from lorabus.security.signing import CommandSigner, CommandVerifier

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_CALL_DEADLINE_S = 5.0
_STORED_RESULT_MAX_BYTES = 64 * 1024 * 1024
"""nats-server's largest max_payload: a stored result is as large as the
server allowed when it was written (only coordinators may write results);
one over what readers take is answered trimmed (coordinator/fit.py)."""
_stored_results: Reader[UpdateResult] = Reader(UpdateResult, max_bytes=_STORED_RESULT_MAX_BYTES)

_WRONG_LAST_SEQUENCE = (10071, 10164)
"""JetStream's error codes for a write whose expected last sequence is not
the subject's (nats-py maps them to KeyWrongLastSequenceError for an update,
not for a delete)."""

_EXCERPT_BYTES = 96
"""How much of a record that does not decode goes into the log and the trail."""

LEADER = "leader"
COMMITTED = "committed"
INFLIGHT = "inflight"
RESET = "reset"


def inflight_key(adapter: str) -> str:
    """Where the update of ``adapter`` in flight is recorded: a key per
    adapter, as updates of different adapters run at once."""
    return f"{INFLIGHT}.{adapter}"


class CorruptRecord(StoreUnavailable):
    """Raised when a key holds a record that does not decode (written by a
    leaked credential, a bug, a disk): ``key``, its ``revision``, and an
    escaped ``excerpt`` of its first bytes for the audit trail."""

    def __init__(self, key: str, revision: int, error: str, excerpt: str) -> None:
        super().__init__(
            f"{key} holds a record that does not decode (revision {revision}): {error}"
        )
        self.key = key
        self.revision = revision
        self.excerpt = excerpt


class FleetStore:
    def __init__(
        self, state: KeyValue, results: KeyValue, signer: CommandSigner | None = None
    ) -> None:
        """With ``signer``, every record is sealed with it, and a record is read
        only if it is sealed with its key (:mod:`lorabus.security.signing`): anything
        else is a :class:`CorruptRecord`, whoever wrote it."""
        self._state = state
        self._results = results
        self._signer = signer
        self._opener = CommandVerifier([signer.public_key] if signer is not None else [])

    @classmethod
    async def open(
        cls, nc: NatsClient, config: StorageConfig, signer: CommandSigner | None = None
    ) -> FleetStore:
        """Bind to the fleet's buckets. Where nobody has set the fleet up yet,
        set it up (:func:`provision`): that works for a coordinator allowed
        to, as on a development server without permissions; in a deployment
        with roles only the operator may, and this says so."""
        subjects = Subjects(fleet=config.fleet, prefix=config.subject_prefix)
        js = nc.jetstream()
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S * 2):
                try:
                    bound = cls(*await _bind(js, subjects), signer)
                except nats.js.errors.BucketNotFoundError:
                    log.info("fleet %s has no KV buckets yet: setting them up", config.fleet)
                    await provision(nc, config)
                    return cls(*await _bind(js, subjects), signer)
        except (TimeoutError, nats.errors.Error) as exc:
            raise StoreUnavailable(
                f"cannot open the KV buckets of fleet {config.fleet!r} ({exc!r}); if they do "
                "not exist and this identity may not create them, run lorabus provision "
                "as the fleet's operator"
            ) from exc
        if config.tenants_file:
            await make_tenant_stores(nc, config)
        return bound

    @classmethod
    async def bind(cls, nc: NatsClient, subjects: Subjects) -> FleetStore:
        """The fleet's buckets as they are, to read (never set up, records not
        checked for a seal): for a part that only looks (``lorabus adapter
        list``). StoreUnavailable when they cannot be bound."""
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S):
                return cls(*await _bind(nc.jetstream(), subjects))
        except (TimeoutError, nats.errors.Error) as exc:
            raise StoreUnavailable(f"cannot read the fleet's KV buckets: {exc!r}") from exc

    # -- leader ---------------------------------------------------------------

    async def read_leader(self) -> tuple[LeaderRecord | None, int]:
        """The leader record and its revision (0 when there is none yet)."""
        return await self._read(self._state, LEADER, LeaderRecord)

    async def write_leader(self, record: LeaderRecord, last_revision: int) -> int:
        """Compare-and-set the leader record; return its new revision or raise LostRace."""
        return await self._swap(LEADER, "the leader record", record, last_revision)

    # -- committed state and the update in flight -------------------------------

    async def read_committed(self, adapter: str | None = None) -> CommittedRecord | None:
        key = COMMITTED if adapter is None else f"{COMMITTED}.{adapter}"
        return (await self._read(self._state, key, CommittedRecord))[0]

    async def write_committed(self, record: CommittedRecord) -> None:
        """Both keys, the commit point first (:meth:`commit`, :meth:`write_latest`)."""
        await self.commit(record)
        await self.write_latest(record)

    async def commit(self, record: CommittedRecord) -> None:
        """The commit point: the adapter's own key. A successor checks an update
        left in flight against it, and nothing rewrites it afterwards but
        the replacement of a placed worker that left, which changes only
        where it is served (``replacement.py``)."""
        await self._put(self._state, f"{COMMITTED}.{record.adapter}", msgspec.json.encode(record))

    async def read_commit_point(self, adapter: str) -> tuple[CommittedRecord | None, int]:
        """The adapter's commit point and its revision, for :meth:`move_commit_point`."""
        return await self._read(self._state, f"{COMMITTED}.{adapter}", CommittedRecord)

    async def move_commit_point(self, record: CommittedRecord, last_revision: int) -> None:
        """Rewrite a commit point with other ``workers``, by compare-and-set on
        the revision it was read at: LostRace if anything wrote it since."""
        await self._swap(f"{COMMITTED}.{record.adapter}", "the commit point", record, last_revision)

    async def write_latest(self, record: CommittedRecord) -> None:
        """The fleet's latest commit, which an agent reads when it (re)connects.
        Written after the commit point: a successor that finds the update in
        flight writes it if it lags (coordinator/recovery.py)."""
        await self._put(self._state, COMMITTED, msgspec.json.encode(record))

    async def latest_behind(self, adapter: str) -> bool:
        """Whether the latest record was written before ``adapter``'s own (or
        is missing, or does not decode: a real record replaces garbage): both
        keys are in one bucket, whose revisions only grow."""
        try:
            _, latest = await self._read(self._state, COMMITTED, CommittedRecord)
        except CorruptRecord:
            return True
        _, own = await self._read(self._state, f"{COMMITTED}.{adapter}", CommittedRecord)
        return latest < own

    async def read_adapter_records(
        self,
    ) -> tuple[dict[str, CommittedRecord], dict[str, ResetRecord]]:
        """Every adapter's commit point and latest reset, as stored now, by
        adapter. CorruptRecord when one does not decode: what it names is
        unknown, and a caller deciding what may be deleted must not guess."""
        committed = {
            key.removeprefix(f"{COMMITTED}."): record
            for key in await self._keys(f"{COMMITTED}.>")
            if (record := (await self._read(self._state, key, CommittedRecord))[0]) is not None
        }
        resets = {
            key.removeprefix(f"{RESET}."): reset
            for key in await self._keys(f"{RESET}.>")
            if (reset := (await self._read(self._state, key, ResetRecord))[0]) is not None
        }
        return committed, resets

    async def read_commit_points(
        self,
    ) -> tuple[dict[str, CommittedRecord], list[CorruptRecord]]:
        """Every adapter's commit point that decodes, by adapter, and the
        errors of those that do not (left out here: a caller that must not
        guess reads :meth:`read_adapter_records`). StoreUnavailable when the
        keys, or a record, cannot be read."""
        points: dict[str, CommittedRecord] = {}
        corrupt: list[CorruptRecord] = []
        for key in await self._keys(f"{COMMITTED}.>"):
            try:
                record = (await self._read(self._state, key, CommittedRecord))[0]
            except CorruptRecord as exc:
                corrupt.append(exc)
                continue
            if record is not None:  # None: removed by a reset
                points[key.removeprefix(f"{COMMITTED}.")] = record
        return points, corrupt

    async def _keys(self, pattern: str) -> list[str]:
        """The state bucket's keys that match ``pattern``, from its stream's
        info: nats-py's ``keys()`` creates a consumer, which the coordinator's
        role may not (lorabus.security.roles)."""
        try:
            # nats-py's KeyValue keeps these private: a binding without them
            # (another nats-py, a test double) cannot list, which is no crash.
            js, stream, name = self._state._js, self._state._stream, self._state._name
        except AttributeError as exc:
            raise StoreUnavailable(f"cannot list the keys {pattern}: {exc}") from exc
        prefix = f"$KV.{name}."
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S):
                info = await js.stream_info(stream, subjects_filter=prefix + pattern)
        except (TimeoutError, nats.errors.Error) as exc:
            raise StoreUnavailable(f"cannot list the keys {pattern}: {exc!r}") from exc
        return sorted(subject.removeprefix(prefix) for subject in info.state.subjects or {})

    async def read_reset(self, adapter: str) -> ResetRecord | None:
        return (await self._read(self._state, f"{RESET}.{adapter}", ResetRecord))[0]

    async def reset_committed(self, record: ResetRecord) -> None:
        """Record the reset, then remove what was committed for its adapter (and
        the latest record, if it is that adapter's): the lineage is written
        first, so no later commit can reuse a name of an earlier lineage."""
        await self._put(self._state, f"{RESET}.{record.adapter}", msgspec.json.encode(record))
        try:
            latest = await self.read_committed()
        except CorruptRecord:  # whose it was is unknown: the next commit replaces it
            latest = None
        await self._delete(self._state, f"{COMMITTED}.{record.adapter}")
        if latest is not None and latest.adapter == record.adapter:
            await self._delete(self._state, COMMITTED)

    async def inflight_keys(self) -> list[str]:
        """The keys of the updates in flight: one per adapter
        (``inflight.<adapter>``), and ``inflight`` where a version-6 leader
        left its one record. StoreUnavailable when they cannot be listed."""
        return await self._keys(INFLIGHT) + await self._keys(f"{INFLIGHT}.>")

    async def read_inflights(self) -> list[InflightRecord]:
        """Every update in flight, as stored now (CorruptRecord when one does
        not decode)."""
        entries = [await self.read_inflight_entry(key) for key in await self.inflight_keys()]
        return [record for record, _ in entries if record is not None]

    async def read_inflight_entry(self, key: str) -> tuple[InflightRecord | None, int]:
        """The in-flight record under ``key`` and its revision (that of its
        deletion when there is none, 0 when there never was one)."""
        return await self._read(self._state, key, InflightRecord)

    async def write_inflight(self, record: InflightRecord) -> int:
        """Write the record under its adapter's key, whatever is there; return
        its revision."""
        return await self._put(
            self._state, inflight_key(record.adapter), msgspec.json.encode(record)
        )

    async def record(self, in_flight: InflightRecord) -> int:
        """The lifecycle's journal: the update in flight, for a successor."""
        return await self.write_inflight(in_flight)

    async def swap_inflight(self, key: str, record: InflightRecord, last_revision: int) -> int:
        """Compare-and-set the in-flight record under ``key`` over revision
        ``last_revision`` (0: only where there is none); return its new
        revision, or raise LostRace when somebody wrote it since."""
        return await self._swap(key, "the in-flight record", record, last_revision)

    async def clear_inflight(self, key: str, last_revision: int) -> None:
        """Delete the in-flight record under ``key`` if it is still revision
        ``last_revision``; LostRace when somebody wrote it since (it is
        theirs now)."""
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S):
                await self._state.delete(key, last=last_revision)
        except nats.js.errors.APIError as exc:
            wrong_last = isinstance(exc, nats.js.errors.KeyWrongLastSequenceError)
            if wrong_last or exc.err_code in _WRONG_LAST_SEQUENCE:
                raise LostRace(
                    f"the in-flight record {key} changed under revision {last_revision}"
                ) from exc
            raise StoreUnavailable(f"cannot delete the in-flight record {key}: {exc!r}") from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise StoreUnavailable(f"cannot delete the in-flight record {key}: {exc!r}") from exc

    # -- results ----------------------------------------------------------------

    async def read_result(self, update_id: str) -> UpdateResult | None:
        key = result_key(update_id)
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S):
                entry = await self._results.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        except (TimeoutError, nats.errors.Error) as exc:
            raise StoreUnavailable(f"cannot read result {update_id}: {exc!r}") from exc
        if entry.value is None:
            return None
        try:
            return _stored_results.decode(self._opener.open_record(key, entry.value))
        except ValueError as exc:  # not sealed by the fleet's key: not the fleet's result
            raise CorruptRecord(key, int(entry.revision or 0), str(exc), "") from exc

    async def write_result(self, result: UpdateResult) -> None:
        await self._put(self._results, result_key(result.update_id), msgspec.json.encode(result))

    # -- plumbing -----------------------------------------------------------------

    async def _read(self, kv: KeyValue, key: str, kind: type[_T]) -> tuple[_T | None, int]:
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S):
                entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError as exc:
            # A deleted key still has a revision, which a create must name.
            entry_of_delete = getattr(exc, "entry", None)
            return None, int(getattr(entry_of_delete, "revision", 0) or 0)
        except (TimeoutError, nats.errors.Error) as exc:
            raise StoreUnavailable(f"cannot read {key}: {exc!r}") from exc
        if entry.value is None:  # an expired key can come back without a value
            return None, int(entry.revision or 0)
        revision = int(entry.revision or 0)
        try:
            return msgspec.json.decode(
                self._opener.open_record(key, entry.value), type=kind
            ), revision
        except (msgspec.DecodeError, ValueError) as exc:
            # Unreadable, not absent: a caller that would act on "none" must not.
            excerpt = repr(bytes(entry.value[:_EXCERPT_BYTES]))
            raise CorruptRecord(key, revision, str(exc)[:256], excerpt) from exc

    async def _swap(self, key: str, what: str, record: object, last_revision: int) -> int:
        """Compare-and-set ``key`` of the state bucket over ``last_revision`` (0:
        only where there is none); its new revision, or LostRace."""
        payload = self._sealed(key, msgspec.json.encode(record))
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S):
                if last_revision == 0:
                    return int(await self._state.create(key, payload))
                return int(await self._state.update(key, payload, last=last_revision))
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise LostRace(f"{what} changed under revision {last_revision}") from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise StoreUnavailable(f"cannot write {what}: {exc!r}") from exc

    async def _delete(self, kv: KeyValue, key: str) -> None:
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S):
                await kv.delete(key)
        except nats.js.errors.KeyNotFoundError:
            return
        except (TimeoutError, nats.errors.Error) as exc:
            raise StoreUnavailable(f"cannot delete {key}: {exc!r}") from exc

    def _sealed(self, key: str, payload: bytes) -> bytes:
        return payload if self._signer is None else self._signer.seal(key, payload)

    async def _put(self, kv: KeyValue, key: str, payload: bytes) -> int:
        payload = self._sealed(key, payload)
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S):
                return int(await kv.put(key, payload))
        except (TimeoutError, nats.errors.Error) as exc:
            raise StoreUnavailable(f"cannot write {key}: {exc!r}") from exc


async def _bind(js: JetStreamContext, subjects: Subjects) -> tuple[KeyValue, KeyValue]:
    return (
        await js.key_value(subjects.state_bucket()),
        await js.key_value(subjects.results_bucket()),
    )


def result_key(update_id: str) -> str:
    # Update ids are free text; KV keys are not. A hex digest is a safe key.
    return "r." + hashlib.sha256(update_id.encode()).hexdigest()[:32]


async def until_stored(call: Callable[[], Awaitable[_T]], *, for_s: float = math.inf) -> _T:
    """``call()`` again, after a pause growing from 0.2 s to 5 s, while it
    raises StoreUnavailable; past ``for_s`` the last such error is raised."""
    give_up_at = now() + for_s
    pause = 0.2
    while True:
        raise_if_cancelled()
        try:
            return await call()
        except StoreUnavailable as exc:
            if now() >= give_up_at:
                raise
            log.warning("%s; retrying in %.1fs", exc, pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 5.0)


async def quietly(awaitable: Awaitable[object]) -> bool:
    """Await a store write whose failure must not stop the fleet (it is logged);
    False when it failed."""
    try:
        await awaitable
    except StoreUnavailable as exc:
        log.warning("store: %s", exc)
        return False
    return True


async def or_none(awaitable: Awaitable[_T]) -> _T | None:
    """Await a store read; an unreachable store reads as "nothing there" (logged)."""
    try:
        return await awaitable
    except StoreUnavailable as exc:
        log.warning("store: %s", exc)
        return None
