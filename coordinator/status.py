"""The fleet's status, as the leader sees it.

What ``lorabus status`` shows: the live members with their engines' state
and their place in the latest commit's rank map (with nothing committed, in
a rank map of the live members), the latest commit, every adapter's commit
(the versions kept beside it, and which live members hold it: those whose
heartbeat lists its served name), every update running (those of different
adapters run at once) with its phase and, for the one running longest,
which members have acked its phase, and any worker id that a second live
agent claims. Read from memory alone (the membership, the term's book, which
learned every adapter's commit point when the term began, the open ack
gather), so it costs no round trip.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lorabus.coordinator.book import UpdateBook
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.gather import AckRouter, PhaseGather
from lorabus.coordinator.membership import Member, Membership
from lorabus.coordinator.plan import CheckedRequest
from lorabus.schemas import (
    AdapterStatus,
    CommittedRecord,
    FleetStatus,
    MemberStatus,
    RunningUpdate,
    WorkerIdConflict,
    build_rank_map,
)


def fleet_status(
    config: CoordinatorConfig,
    membership: Membership,
    book: UpdateBook,
    acks: AckRouter | None,
    *,
    epoch: int,
    leader: str,
) -> FleetStatus:
    live = membership.live()
    latest = book.latest
    rank_map = (
        latest.rank_map
        if latest
        else build_rank_map(
            {wid: m.heartbeat.world_size for wid, m in live.items()}, membership.layouts(live)
        )
    )
    offsets = {entry.worker_id: entry.rank_offset for entry in rank_map.entries}
    members = [
        MemberStatus(
            worker_id=wid,
            world_size=m.heartbeat.world_size,
            engine=m.heartbeat.engine,
            paused=m.heartbeat.paused,
            adapters=m.heartbeat.adapters,
            heartbeat_age_s=round(membership.age_of(m), 3),
            rank_offset=offsets.get(wid),
            ready=m.heartbeat.ready,
            unready_reason=m.heartbeat.unready_reason,
            missing=m.heartbeat.missing,
            unreadable_state=m.heartbeat.unreadable_state,
            capacity=m.heartbeat.capacity,
            labels=m.heartbeat.labels,
            role=m.heartbeat.role,
            data_parallel=m.heartbeat.data_parallel,
        )
        for wid, m in sorted(live.items())
    ]
    return FleetStatus(
        fleet=config.fleet,
        expected_world_size=config.expected_world_size,
        live_world_size=sum(m.world_size for m in members),
        members=members,
        committed_adapter=latest.served_name if latest else None,
        committed_version=latest.version if latest else None,
        rank_map=latest.rank_map if latest else None,
        in_flight=book.running,
        epoch=epoch,
        leader=leader,
        conflicts=[
            WorkerIdConflict(
                worker_id=contender.heartbeat.worker_id,
                holder=membership.instance_of(contender.heartbeat.worker_id) or "",
                refused=contender.heartbeat.instance,
                age_s=age_s,
            )
            for contender, age_s in membership.conflicts()
        ],
        running=[
            RunningUpdate(
                update_id=checked.update_id,
                adapter=checked.adapter,
                live=checked.live,
                phase=str(gather.phase)
                if (gather := _gather_of(acks, checked.update_id))
                else None,
            )
            for checked in book.running_updates()
        ],
        adapters=_adapters(book.committed, live),
        **_phase_progress(book, acks),
    )


def _adapters(
    committed: Mapping[str, CommittedRecord], live: Mapping[str, Member]
) -> list[AdapterStatus]:
    """Each committed adapter, by name, with the live members that hold its
    committed version (one pass over the members' lists: a thousand
    members of a few dozen adapters each)."""
    adapter_of = {record.served_name: adapter for adapter, record in committed.items()}
    holders: dict[str, list[str]] = {adapter: [] for adapter in committed}
    for wid, member in sorted(live.items()):
        for name in set(member.heartbeat.adapters):
            if (adapter := adapter_of.get(name)) is not None:
                holders[adapter].append(wid)
    return [
        AdapterStatus(
            adapter=adapter,
            served_name=record.served_name,
            version=record.version,
            path=record.path,
            digest=record.digest,
            committed_at=record.committed_at,
            holders=holders[adapter],
            kept=[version.served_name for version in record.kept],
            placed=record.workers,
        )
        for adapter, record in sorted(committed.items())
    ]


def _running(checked: CheckedRequest, gather: PhaseGather | None) -> RunningUpdate:
    return RunningUpdate(
        update_id=checked.update_id,
        adapter=checked.adapter,
        live=checked.live,
        phase=str(gather.phase) if gather is not None else None,
    )


def _gather_of(acks: AckRouter | None, update_id: str) -> PhaseGather | None:
    return acks.latest(update_id) if acks is not None else None


def _phase_progress(book: UpdateBook, acks: AckRouter | None) -> dict[str, Any]:
    """The phase of the update running longest, and who has acked it."""
    gather = _gather_of(acks, book.running) if book.running is not None else None
    if gather is None:
        return {}
    return {
        "in_flight_phase": str(gather.phase),
        "acked": sorted(gather.acks),
        "waiting": sorted(gather.waiting),
    }
