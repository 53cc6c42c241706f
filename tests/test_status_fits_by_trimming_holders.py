"""A status of a thousand members that each serve a hundred adapters outgrows
what one message carries even without the members' adapter lists: each
adapter's holders are left out next, and said so, while every adapter's
commit stays; the text still reads at that size."""

from __future__ import annotations

import time

import msgspec

from lorabus.audit.render import status_text
from lorabus.coordinator.book import UpdateBook
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.fit import fit_status
from lorabus.coordinator.membership import Membership
from lorabus.coordinator.status import fleet_status
from lorabus.schemas import (
    MAX_MESSAGE_BYTES,
    CommittedRecord,
    FleetStatus,
    Heartbeat,
    KeptVersion,
    build_rank_map,
    encode,
)

WORKERS = 1024
ADAPTERS = 120
AT = 1_000.0


def _large_fleet() -> FleetStatus:
    """The leader's status of WORKERS members, each serving every adapter's
    committed version, with the real status builder."""
    worker_ids = [f"w{i:04d}" for i in range(WORKERS)]
    served = [f"adapter-{a:03d}-v7" for a in range(ADAPTERS)]
    membership = Membership(clock=lambda: AT)
    for wid in worker_ids:
        membership.observe(
            Heartbeat(
                worker_id=wid,
                world_size=1,
                engine="dynamo",
                adapters=served,
                paused=False,
                interval_s=1.0,
            )
        )
    book = UpdateBook()
    rank_map = build_rank_map(dict.fromkeys(worker_ids, 1))
    points = [
        CommittedRecord(
            adapter=f"adapter-{a:03d}",
            version=7,
            path=f"/adapters/{a:03d}/7",
            served_name=f"adapter-{a:03d}-v7",
            rank_map=rank_map,
            digest="sha256:" + "ab" * 32,
            committed_at=time.time() - 90,
            kept=[KeptVersion(version=6, served_name=f"adapter-{a:03d}-v6", path=f"/a/{a:03d}/6")],
        )
        for a in range(ADAPTERS)
    ]
    book.learn(points)
    config = CoordinatorConfig(fleet="f", frontend_url="http://x", expected_world_size=WORKERS)
    return fleet_status(config, membership, book, None, epoch=3, leader="c1")


def test_each_adapter_lists_the_live_members_that_hold_it() -> None:
    status = _large_fleet()

    assert [a.adapter for a in status.adapters] == [f"adapter-{a:03d}" for a in range(ADAPTERS)]
    assert all(len(a.holders) == WORKERS for a in status.adapters)
    assert status.adapters[0].kept == ["adapter-000-v6"]


def test_holders_go_after_the_members_adapter_lists_and_before_anything_else() -> None:
    status = _large_fleet()
    members = [msgspec.structs.replace(m, adapters=[]) for m in status.members]
    without_lists = msgspec.structs.replace(status, members=members)
    assert len(encode(without_lists)) > MAX_MESSAGE_BYTES  # the holders alone outgrow it

    fitted = fit_status(status, MAX_MESSAGE_BYTES)

    assert fitted.trimmed == ["adapters", "holders"]
    assert len(encode(fitted)) <= MAX_MESSAGE_BYTES
    assert all(m.adapters == [] for m in fitted.members)
    # Every adapter's commit is still said, and who holds it is not.
    assert [(a.adapter, a.served_name, a.version, a.kept) for a in fitted.adapters] == [
        (a.adapter, a.served_name, a.version, a.kept) for a in status.adapters
    ]
    assert all(a.holders == [] for a in fitted.adapters)
    assert fitted.rank_map == status.rank_map


def test_the_text_of_a_large_fleet_counts_holders_and_says_what_was_left_out() -> None:
    status = _large_fleet()
    text = status_text(status)
    trimmed = status_text(fit_status(status, MAX_MESSAGE_BYTES))

    line = next(line for line in text.splitlines() if line.startswith("  adapter-007:"))
    assert line == (
        "  adapter-007: adapter-007-v7 (version 7, sha256:abababababab), committed 2m ago; "
        f"held by all {WORKERS} live members; kept beside it: adapter-007-v6"
    )
    assert "w0001" not in line
    assert "left out to fit the bus's message size limit: adapters, holders" in trimmed
    assert "holders left out (message size limit)" in trimmed
