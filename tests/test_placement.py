"""Placement's choice of workers (coordinator/placement.py), as a function of
what the workers announce and what the fleet has committed: no bus."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest

from lorabus.agents.desired import DesiredState, Target
from lorabus.coordinator.placement import (
    Placement,
    Served,
    eligible,
    never_placeable,
    place,
    serving,
    wait_for_whom,
)
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


def _unready(worker: str, reason: str, **labels: str) -> Heartbeat:
    return msgspec.structs.replace(_beat(worker, **labels), ready=False, unready_reason=reason)


def _beats(count: int, **labels: str) -> dict[str, Heartbeat]:
    return {f"w{i}": _beat(f"w{i}", **labels) for i in range(count)}


def _choose(adapter: str, placement: Placement, beats: dict[str, Heartbeat], **kw: object):
    kw.setdefault("now_on", [])
    kw.setdefault("beside", [])
    kw.setdefault("own", [f"{adapter}-v1"])
    return place(adapter, placement, beats, **kw)  # type: ignore[arg-type]


def test_only_replicas_or_a_selector_make_a_placement() -> None:
    assert Placement().everywhere
    assert not Placement(replicas=2).everywhere
    assert not Placement(selector={"zone": "a"}).everywhere
    assert Placement(replicas=2, selector={"zone": "a"}).describe() == "2 worker(s) labelled zone=a"


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
    assert _choose("p", Placement(replicas=1, selector={"zone": "a"}), beats) in (["a1"], ["a2"])
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


def test_room_comes_before_load_and_before_staying() -> None:
    # w0 holds one adapter of its capacity of one; w1 holds two, unbounded.
    beats = {"w0": _beat("w0", capacity=1), "w1": _beat("w1")}
    beside = [Served("a-v1", ("w0", "w1")), Served("b-v1", ("w1",))]
    # By load alone w0 would come first: it has no room.
    assert _choose("p", Placement(replicas=1), beats, beside=beside) == ["w1"]
    # Nor does serving the adapter now keep it on a worker without room for the next version.
    with_p = [*beside, Served("p-v1", ("w0",))]
    own = ["p-v2", "p-v1"]
    assert _choose("p", Placement(replicas=1), beats, beside=with_p, own=own, now_on=["w0"]) == [
        "w1"
    ]
    # Where only workers without room are left, they are chosen (and the
    # update then fails no_capacity), unless with room only.
    assert _choose("p", Placement(replicas=2), beats, beside=beside) == ["w0", "w1"]
    assert _choose("p", Placement(replicas=2), beats, beside=beside, with_room_only=True) is None
    # The versions it keeps count: a new worker must hold them all.
    roomy = {"w0": _beat("w0", capacity=2), "w1": _beat("w1", capacity=3)}
    three = ["p-v3", "p-v2", "p-v1"]
    assert _choose("p", Placement(replicas=1), roomy, own=three, with_room_only=True) == ["w1"]


def test_who_an_update_waits_for_before_it_chooses() -> None:
    live = {
        "w0": _beat("w0", zone="a"),
        "w1": _unready("w1", "", zone="a"),
        "w2": _unready("w2", "cannot load: the engine refuses", zone="a"),
        "w3": _unready("w3", "", zone="b"),
    }
    gone = {"w9"}

    def not_gone(worker: str) -> bool:
        return worker not in gone

    replicas = Placement(replicas=2, selector={"zone": "a"})
    # Those that serve it now: back from a restart soon (w5), loading (w1);
    # not one that says it will not become ready (w2), nor one gone (w9).
    assert wait_for_whom(replicas, live, ["w0", "w1", "w2", "w5", "w9"], not_gone) == [
        "w1",
        "w5",
    ]
    # A selector alone: every live match that is not ready yet, too.
    every_a = Placement(selector={"zone": "a"})
    assert wait_for_whom(every_a, live, [], not_gone) == ["w1"]
    # A worker that serves it now but no longer matches is not waited for.
    assert wait_for_whom(every_a, live, ["w3"], not_gone) == ["w1"]


def test_a_placement_no_remembered_worker_meets_is_known_at_once() -> None:
    remembered = {**_beats(3), "b0": _beat("b0", zone="b")}
    assert never_placeable(Placement(replicas=4), remembered) is None
    assert "the fleet has 4" in (never_placeable(Placement(replicas=5), remembered) or "")
    assert never_placeable(Placement(selector={"zone": "b"}), remembered) is None
    assert never_placeable(Placement(selector={"zone": "c"}), remembered) is not None


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


def test_a_worker_unloads_what_is_placed_elsewhere_up_to_the_committed_version() -> None:
    desired = DesiredState("w1")
    desired.learn(
        Target(
            adapter="p", served_name="p-r1-v5", path="bus:x", version=5, lineage=1, workers=("w0",)
        )
    )
    desired.learn(Target(adapter="q", served_name="q-v2", path="/q", version=2))
    held = ["p-v9", "p-r1-v4", "p-r1-v5", "p-r1-v6", "q-v1", "q-v2", "pq-v1"]
    # Every version of an earlier lineage, its own up to the committed one;
    # not a newer one (an update placing it here may be loading it now).
    assert desired.unplaced(held, "p") == ["p-r1-v4", "p-r1-v5", "p-v9"]
    assert desired.unplaced(held) == ["p-r1-v4", "p-r1-v5", "p-v9"]
    assert desired.unplaced(held, "q") == []  # placed everywhere
    assert {w.served_name for w in desired.wanted()} == {"q-v2"}
    # What a load at capacity may give up: those, and q's older version.
    assert set(desired.stale(held)) == {"p-r1-v4", "p-r1-v5", "p-v9", "q-v1"}
    # On w0, where p is placed, p's committed version is required.
    here = DesiredState("w0")
    here.learn(desired.targets["p"])
    assert here.unplaced(held) == [] and "p-r1-v5" in here.names()
