"""Placement's choice of workers (coordinator/placement.py), as a function of
what the workers announce and what the fleet has committed: no bus."""

from __future__ import annotations

from collections import Counter

import pytest

from lorabus.coordinator.placement import Placement, Served, eligible, place, serving
from lorabus.schemas import CommittedRecord, Heartbeat, RankMap
from lorabus.schemas.bounds import parse_labels


def _beat(worker: str, *, capacity: int | None = None, **labels: str) -> Heartbeat:
    return Heartbeat(
        worker_id=worker,
        world_size=1,
        engine="sim",
        adapters=[],
        paused=False,
        interval_s=1.0,
        capacity=capacity,
        labels=labels,
    )


def _beats(count: int, **labels: str) -> dict[str, Heartbeat]:
    return {f"w{i}": _beat(f"w{i}", **labels) for i in range(count)}


def _choose(adapter: str, placement: Placement, beats: dict[str, Heartbeat], **kw: object):
    kw.setdefault("now_on", [])
    kw.setdefault("beside", [])
    return place(adapter, placement, beats, served_name=f"{adapter}-v1", **kw)  # type: ignore[arg-type]


def test_an_update_without_placement_is_everywhere() -> None:
    assert Placement().everywhere
    assert not Placement(replicas=2).everywhere
    assert not Placement(selector={"zone": "a"}).everywhere
    beats = _beats(3)
    assert _choose("p", Placement(), beats) == ["w0", "w1", "w2"]


def test_a_selector_chooses_by_every_label() -> None:
    beats = {
        "a1": _beat("a1", zone="a", gpu="h100"),
        "a2": _beat("a2", zone="a", gpu="a10"),
        "b1": _beat("b1", zone="b", gpu="h100"),
        "bare": _beat("bare"),
    }
    assert eligible({"zone": "a"}, beats) == ["a1", "a2"]
    assert eligible({"zone": "a", "gpu": "h100"}, beats) == ["a1"]
    assert eligible({}, beats) == sorted(beats)
    assert _choose("p", Placement(selector={"gpu": "h100"}), beats) == ["a1", "b1"]
    # Too few match: no placement (the update waits, then fails its quorum).
    assert _choose("p", Placement(replicas=3, selector={"gpu": "h100"}), beats) is None
    assert _choose("p", Placement(selector={"zone": "c"}), beats) is None


def test_the_next_version_stays_where_the_adapter_is_served() -> None:
    beats = _beats(8)
    first = _choose("p", Placement(replicas=3), beats)
    assert first is not None and len(first) == 3
    # Whatever the load elsewhere, the workers that serve it stay.
    loaded = [Served(f"other-{i}", tuple(first)) for i in range(5)]
    assert _choose("p", Placement(replicas=3), beats, now_on=first, beside=loaded) == first
    # One more replica: the three stay, one joins.
    more = _choose("p", Placement(replicas=4), beats, now_on=first, beside=loaded)
    assert more is not None and set(first) < set(more)
    # One fewer: two of the three.
    fewer = _choose("p", Placement(replicas=2), beats, now_on=first)
    assert fewer is not None and set(fewer) < set(first)
    # A worker that left is replaced by another.
    gone = {w: b for w, b in beats.items() if w != first[0]}
    moved = _choose("p", Placement(replicas=3), gone, now_on=first)
    assert moved is not None and set(first[1:]) < set(moved) and first[0] not in moved


def test_adapters_spread_within_one_of_even() -> None:
    beats = _beats(7)
    records: list[CommittedRecord] = []
    for i in range(20):
        adapter = f"tenant-{i}"
        chosen = _choose(adapter, Placement(replicas=3), beats, beside=serving(records))
        assert chosen is not None and len(chosen) == 3
        records.append(_record(adapter, chosen))
    counts = Counter(w for r in records for w in r.workers)
    assert set(counts) == set(beats)
    assert max(counts.values()) - min(counts.values()) <= 1, counts


def test_a_worker_without_room_is_chosen_last() -> None:
    beats = {"w0": _beat("w0", capacity=2), "w1": _beat("w1", capacity=2), "w2": _beat("w2")}
    full = [Served("a-v1", ("w0", "w1")), Served("b-v1", ("w0",))]
    # w0 holds 2 of 2: the new one goes to w1 (room for one more) and w2.
    assert _choose("p", Placement(replicas=2), beats, beside=full) == ["w1", "w2"]


def test_serving_lists_where_each_name_is_placed() -> None:
    records = [
        _record("a", ["w1", "w0"]),
        _record("b", []),
    ]
    assert serving(records) == [Served("a-v1", ("w0", "w1")), Served("b-v1", ())]
    assert Served("a-v1", ("w0",)).on("w0") and not Served("a-v1", ("w0",)).on("w1")
    assert Served("b-v1").on("anyone")


def test_labels_are_key_value_tokens() -> None:
    assert parse_labels(["zone=a", "gpu=h100"]) == {"zone": "a", "gpu": "h100"}
    for bad in (["zone"], ["=a"], ["zone="], ["zo ne=a"], ["zone=a", "zone=b"], ["a.b=c/d"]):
        with pytest.raises(ValueError, match="label"):
            parse_labels(bad)
    with pytest.raises(ValueError, match="at most"):
        parse_labels([f"k{i}=v" for i in range(17)])


def _record(adapter: str, workers: list[str]) -> CommittedRecord:
    return CommittedRecord(
        adapter=adapter,
        version=1,
        path="/a",
        served_name=f"{adapter}-v1",
        rank_map=RankMap(world_size=1, membership_version=1, entries=[]),
        workers=workers,
    )
