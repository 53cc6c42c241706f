"""Rank offsets follow worker-id order and each worker's own world size; each
entry says its worker's role and data-parallel ranks."""

from __future__ import annotations

import pytest

from lorabus.audit.render import rank_map_text
from lorabus.schemas import WorkerRole, build_rank_map


def test_heterogeneous_world_sizes_get_offsets_after_the_trainer() -> None:
    rank_map = build_rank_map({"c": 1, "a": 2, "b": 4})

    assert [(e.worker_id, e.rank_offset) for e in rank_map.entries] == [
        ("a", 1),
        ("b", 3),
        ("c", 7),
    ]
    assert rank_map.world_size == 8


def test_workers_are_ordered_by_plain_string_order() -> None:
    rank_map = build_rank_map({"w2": 1, "w10": 1})

    assert [e.worker_id for e in rank_map.entries] == ["w10", "w2"]


def test_membership_version_changes_with_membership_only() -> None:
    same = build_rank_map({"a": 1, "b": 2}).membership_version
    assert build_rank_map({"b": 2, "a": 1}).membership_version == same
    assert build_rank_map({"a": 1, "b": 4}).membership_version != same
    assert build_rank_map({"a": 1}).membership_version != same


def test_a_world_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="world size 0"):
        build_rank_map({"a": 0})


def test_each_entry_says_its_role_and_data_parallel_ranks() -> None:
    layouts = {"p": (WorkerRole.PREFILL, 1), "d": (WorkerRole.DECODE, 2)}
    rank_map = build_rank_map({"a": 1, "d": 4, "p": 2}, layouts)

    entries = {e.worker_id: (e.role, e.data_parallel, e.rank_offset) for e in rank_map.entries}
    assert entries == {
        "a": (WorkerRole.AGGREGATED, 1, 1),
        "d": (WorkerRole.DECODE, 2, 2),
        "p": (WorkerRole.PREFILL, 1, 6),
    }
    # Ranks 2-3 are d's first data-parallel engine, 4-5 its second.
    assert "2 data-parallel ranks of 2" in rank_map_text(rank_map)
    assert "decode" in rank_map_text(rank_map) and "prefill" in rank_map_text(rank_map)


def test_a_layout_other_than_the_default_is_another_membership() -> None:
    plain = build_rank_map({"a": 2}).membership_version
    assert build_rank_map({"a": 2}, {"a": (WorkerRole.AGGREGATED, 1)}).membership_version == plain
    assert build_rank_map({"a": 2}, {"a": (WorkerRole.AGGREGATED, 2)}).membership_version != plain
    assert build_rank_map({"a": 2}, {"a": (WorkerRole.PREFILL, 1)}).membership_version != plain
