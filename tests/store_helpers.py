"""What the tests of the adapter store share: a connection to a fleet whose
store exists (as ``lorabus provision`` makes it), and the state a leader
leaves when it dies the moment its commit point lands."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from nats.aio.client import Client as NatsClient

from lorabus.adapters.store import DEFAULT_STORE_MAX_BYTES, store_config
from lorabus.bus.connect import close, connect
from lorabus.coordinator.store import FleetStore
from lorabus.schemas import CommittedRecord, InflightRecord, Phase, Subjects


@contextlib.asynccontextmanager
async def store_connection(
    nats_url: str, subjects: Subjects, *, max_bytes: int = DEFAULT_STORE_MAX_BYTES
) -> AsyncIterator[NatsClient]:
    """A connection to a fleet whose adapter store exists; the store is
    deleted after (the session's server keeps no objects of finished tests)."""
    connection = await connect(nats_url, name="test-adapter-store")
    js = connection.jetstream()
    try:
        await js.add_stream(store_config(subjects, max_bytes=max_bytes))
        yield connection
        await js.delete_stream(f"OBJ_{subjects.adapter_store()}")
    finally:
        await close(connection)


async def leave_a_claimed_commit(
    store: FleetStore, committing: CommittedRecord, members: dict[str, int]
) -> None:
    """The state bucket as a leader leaves it when it dies the moment its
    commit point lands: the update in flight, its commit claimed, and the
    commit point; no result, no latest record, no clean-up."""
    await store.write_inflight(
        InflightRecord(
            update_id=f"{committing.adapter}-{committing.version}",
            epoch=1,
            phase=Phase.LOAD,
            adapter=committing.adapter,
            served_name=committing.served_name,
            version=committing.version,
            members=members,
            path=committing.path,
            committing=committing,
        )
    )
    await store.commit(committing)


async def in_flight_of(store: FleetStore) -> InflightRecord | None:
    """The one update in flight, or None (a test with one adapter)."""
    records = await store.read_inflights()
    assert len(records) <= 1, f"more than one update in flight: {records}"
    return records[0] if records else None
