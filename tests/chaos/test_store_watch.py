"""The chaos run's store sampler, against a real nats-server: it reads the
records, lists the store and reads the records again, so that an object
deleted while a commit point keeps it is caught; a sample that cannot be
read is skipped, not judged.
"""

from __future__ import annotations

from pathlib import Path

from lorabus.adapters.bus_paths import bus_path
from lorabus.adapters.store import delete_object, push_adapter
from lorabus.bus.connect import close, connect
from lorabus.coordinator.config import StorageConfig
from lorabus.coordinator.store import FleetStore
from lorabus.schemas import CommittedRecord, KeptVersion, Subjects, build_rank_map
from lorabus.testbed.chaos import Timeline
from lorabus.testbed.chaos.invariants import check_store_keeps
from lorabus.testbed.chaos.store_watch import StoreWatcher
from lorabus.testbed.trainer import write_adapter


async def test_an_object_deleted_while_a_commit_point_keeps_it_is_caught(
    nats_url: str, fleet_name: str, tmp_path: Path
) -> None:
    subjects = Subjects(fleet=fleet_name)
    timeline = Timeline()
    nc = await connect(nats_url, name="test-store-watch")
    try:
        records = await FleetStore.open(nc, StorageConfig(fleet=fleet_name))  # provisions
        kept, _ = await push_adapter(nc, subjects, write_adapter(tmp_path, 1, with_torch=False))
        committed, _ = await push_adapter(
            nc, subjects, write_adapter(tmp_path, 2, with_torch=False)
        )
        await records.commit(
            CommittedRecord(
                adapter="policy",
                version=2,
                path=bus_path(committed),
                served_name="policy-v2",
                rank_map=build_rank_map({"a": 1}),
                digest=committed,
                kept=[KeptVersion(version=1, served_name="policy-v1", path=bus_path(kept))],
            )
        )
        watcher = StoreWatcher(nc, subjects, records, timeline, every_s=0.5)
        whole = await watcher.sample()
        await delete_object(nc, subjects, kept)  # as a leader that forgot `kept` would
        await watcher.sample()
    finally:
        await close(nc)
    skipped = await watcher.sample()  # the bus is gone

    assert whole is not None and whole.stored == {kept, committed}
    assert check_store_keeps(Timeline(store_samples=[whole])) == []
    [violation] = check_store_keeps(timeline)
    assert violation.subject == kept
    assert "policy v1, kept by the commit point of policy v2" in violation.detail
    assert skipped is None and timeline.store_samples_skipped == 1
    assert len(timeline.store_samples) == 2
