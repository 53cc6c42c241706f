"""The fleet's streams: the two KV buckets', the adapter object store's and
the audit stream, as lorabus sets them up, and the check of what another
hand may have changed.

Whoever may change a stream's configuration may aim JetStream: make it
republish what it stores onto a KV key, take stored commands from another
stream (``sources``), seal a bucket, or answer "stored" onto an ack's reply
subject. So the operator may create the streams (a creation where the stream
already exists with another configuration is refused by the server), and no
lorabus role may change them (docs/security.md, "The fleet's streams"). A
leader checks them when it takes office and reports what it would not have
set (:func:`unsafe_settings`).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.client import JetStreamContext

from lorabus.adapters.store import store_config
from lorabus.coordinator.config import StorageConfig
from lorabus.schemas import Subjects
from lorabus.schemas.tenants import decode_tenants

log = logging.getLogger(__name__)

RESULTS_KEPT_S = 24 * 3600.0
_CALL_DEADLINE_S = 5.0
_NAME_IN_USE = 10058
"""JetStream's error code for a creation whose stream exists with another
configuration."""
_KV_DUPLICATE_WINDOW_S = 120.0


class StreamChangeRefused(Exception):
    """Raised when a fleet's stream exists with other settings than those asked
    for, and this identity may not change them."""


class StreamNotMade(nats.errors.Error):
    """Raised when the server refuses to make a fleet's stream, saying which
    and why. A NATS error: a coordinator setting up its fleet tries again
    (a cluster still placing its peers), ``lorabus provision`` says it."""


def fleet_streams(config: StorageConfig) -> tuple[StreamConfig, ...]:
    """The state bucket's stream, the results bucket's, the adapter object
    store's and the audit stream, as :func:`provision` creates them. The buckets' are what nats-py's
    ``create_key_value`` makes of a one-value history, so that a bucket made
    either way is the same to the server."""
    subjects = Subjects(fleet=config.fleet, prefix=config.subject_prefix)
    buckets = tuple(
        StreamConfig(
            name=f"KV_{bucket}",
            subjects=[f"$KV.{bucket}.>"],
            allow_rollup_hdrs=True,
            allow_msg_ttl=True,
            deny_delete=True,
            discard=DiscardPolicy.NEW,
            duplicate_window=min(_KV_DUPLICATE_WINDOW_S, ttl or _KV_DUPLICATE_WINDOW_S),
            max_age=ttl,
            max_consumers=-1,
            max_msgs=-1,
            max_msgs_per_subject=1,
            num_replicas=config.kv_replicas,
            storage=StorageType.FILE,
        )
        for bucket, ttl in (
            (subjects.state_bucket(), None),
            (subjects.results_bucket(), RESULTS_KEPT_S),
        )
    )
    audit = StreamConfig(
        name=subjects.audit_stream(),
        subjects=subjects.audited(),
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        max_age=config.audit_max_age_s,
        max_bytes=config.audit_max_bytes,
        num_replicas=config.kv_replicas,
        # Nobody erases the trail through the API.
        deny_delete=True,
        deny_purge=True,
        # The auditor reads it message by message (lorabus/audit/tap.py): no consumer.
        allow_direct=True,
        # No "stored" answers: an agent's ack or event keeps the reply
        # subject it was published with, and JetStream would answer there,
        # in the fleet's account (a KV key, say), with its own rights.
        no_ack=True,
    )
    adapters = store_config(
        subjects, replicas=config.kv_replicas, max_bytes=config.adapter_store_max_bytes
    )
    # Each tenant's own store, as large as its quota of bytes.
    tenants = decode_tenants(Path(config.tenants_file).read_bytes()) if config.tenants_file else {}
    own = tuple(
        store_config(subjects.for_store(name), replicas=config.kv_replicas, max_bytes=t.max_bytes)
        for name, t in sorted(tenants.items())
    )
    # The tenants' stores last: one the account's budget cannot hold leaves
    # the fleet's own streams made (provision says which could not be).
    return (*buckets, adapters, audit, *own)


async def provision(nc: NatsClient, config: StorageConfig) -> list[str]:
    """Create the fleet's streams where they do not exist, and bring those that
    do to ``config`` where this identity may (a server without roles); return
    the names of the streams changed. Raise :class:`StreamChangeRefused` when
    one differs and this identity may not change it (the operator's)."""
    js = nc.jetstream()
    changed = []
    for stream in fleet_streams(config):
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S):
                # A creation is a no-op where the stream is already so.
                await js.add_stream(stream)
            continue
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _NAME_IN_USE:
                raise StreamNotMade(_not_made(stream, exc)) from exc
        except nats.js.errors.APIError as exc:
            raise StreamNotMade(_not_made(stream, exc)) from exc
        except TimeoutError as exc:
            # A cluster answers no JetStream request until it has elected its
            # meta leader: the operator (or compose's restart) asks again.
            raise StreamNotMade(
                f"stream {stream.name} could not be made: JetStream did not answer "
                f"within {_CALL_DEADLINE_S:.0f} s (a cluster that has not elected its "
                "JetStream leader yet: try again once its nodes see each other)"
            ) from exc
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S):
                await js.update_stream(stream)
        except (TimeoutError, nats.errors.NoRespondersError) as exc:
            # A permissions violation has no answer: the request times out.
            raise StreamChangeRefused(
                f"stream {stream.name} exists with other settings, and this identity may "
                "not change a stream's configuration (whoever may could aim JetStream at the "
                "fleet's state): see docs/security.md, 'The fleet's streams'"
            ) from exc
        changed.append(str(stream.name))
    return changed


def _not_made(stream: StreamConfig, exc: nats.js.errors.APIError) -> str:
    said = exc.description or repr(exc)
    hint = (
        ": the account's JetStream storage cannot hold it beside the others "
        "(lorabus auth init --jetstream-max-bytes; each tenant's store takes its max_bytes)"
        if "insufficient" in said or "resources" in said
        else ""
    )
    return f"stream {stream.name} could not be made ({said}){hint}"


async def make_tenant_stores(nc: NatsClient, config: StorageConfig) -> list[str]:
    """Make each tenant's adapter store that does not exist yet, where this
    identity may (a server without roles; with roles the operator's
    ``lorabus provision`` does): a tenant added to a running fleet's file
    gets its store at the coordinator's next start. The stores it could not
    make, each said in the log."""
    js = nc.jetstream()
    subjects = Subjects(fleet=config.fleet, prefix=config.subject_prefix)
    missing = []
    for stream in fleet_streams(config):
        if not str(stream.name).startswith(f"OBJ_{subjects.adapter_store()}_t_"):
            continue
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S):
                await js.stream_info(str(stream.name))
            continue
        except nats.js.errors.NotFoundError:
            pass
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("tenant store %s could not be looked at: %r", stream.name, exc)
            continue
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S):
                await js.add_stream(stream)
        except (TimeoutError, nats.errors.Error) as exc:
            missing.append(str(stream.name))
            log.warning(
                "tenant store %s does not exist, and this identity could not make it (%r): "
                "run lorabus provision --tenants FILE as the fleet's operator",
                stream.name,
                exc,
            )
    return missing


# Each would have JetStream write or answer somewhere else, or let the trail
# (or a bucket) be erased or frozen.
_ABSENT = ("republish", "sources", "mirror", "subject_transform")
_GUARDED = (
    "subjects",
    *_ABSENT,
    "sealed",
    "deny_delete",
    "no_ack",
    "allow_msg_schedules",
    "mirror_direct",
)
_AUDIT_GUARDED = ("deny_purge", "allow_direct", "allow_msg_ttl")
_STORE_GUARDED = (
    "allow_rollup_hdrs",
    "max_msgs_per_subject",
    "discard_new_per_subject",
    "discard",
    "max_age",
)
"""What keeps every subject of the adapter store written once and kept until
the leader deletes it: else a publish could replace or remove an object, or
the stream drop one on its own (lorabus/adapters/store.py)."""


def _setting(field: str, value: Any) -> Any:
    """A setting as compared: unset flags are off, empty lists absent."""
    if field == "subjects":
        return sorted(value or [])
    if field in _ABSENT:
        return value or None
    if field == "max_msgs_per_subject":
        return value
    if field == "discard":
        return str(getattr(value, "value", value) or "old")
    if field == "max_age":
        return value or 0
    return bool(value)


async def unsafe_settings(js: JetStreamContext, config: StorageConfig) -> list[tuple[str, str]]:
    """What of the fleet's streams is set otherwise than lorabus sets it, in
    the settings that decide where JetStream writes and answers and whether
    the trail can be erased: (stream, what) for each. A stream that cannot be
    read is said so too."""
    found = []
    streams = fleet_streams(config)
    audit_name = Subjects(fleet=config.fleet, prefix=config.subject_prefix).audit_stream()
    stores = {s.name for s in streams if str(s.name).startswith("OBJ_")}
    for canonical in streams:
        name = str(canonical.name)
        try:
            async with asyncio.timeout(_CALL_DEADLINE_S):
                info = await js.stream_info(name)
        except (TimeoutError, nats.errors.Error) as exc:
            found.append((name, f"stream {name} could not be read: {exc!r}"[:256]))
            continue
        guarded = (
            *_GUARDED,
            *(_AUDIT_GUARDED if name == audit_name else ()),
            *(_STORE_GUARDED if name in stores else ()),
        )
        for field in guarded:
            wanted = _setting(field, getattr(canonical, field))
            actual = _setting(field, getattr(info.config, field, None))
            if actual != wanted:
                found.append(
                    (name, f"stream {name}: {field} is {actual!r}, lorabus sets {wanted!r}")
                )
    return found
