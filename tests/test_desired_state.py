"""The rules of an agent's desired state (agents/desired.py), case by case: what
a record or a notice changes for its adapter, where a version-6 notice goes,
what a read of KV forgets, and how an unready reason stays within its bound."""

from __future__ import annotations

import msgspec

from lorabus.agents.desired import (
    COMMITTED_VIEW,
    DesiredState,
    Target,
    Wanted,
    adapter_of_notice,
    target_of_notice,
    target_of_record,
    unready_text,
)
from lorabus.schemas import CommittedNotice, CommittedRecord, KeptVersion, build_rank_map


def _notice(served_name: str, version: int, **fields: object) -> CommittedNotice:
    return CommittedNotice(
        update_id="u",
        budget_s=0,
        served_name=served_name,
        path=f"/adapters/{served_name}",
        version=version,
        **fields,  # type: ignore[arg-type]
    )


def _kept(served_name: str, version: int) -> KeptVersion:
    return KeptVersion(version=version, served_name=served_name, path=f"/adapters/{served_name}")


def _target(adapter: str, version: int, *, lineage: int = 0, kept: int = 0) -> Target:
    name = f"{adapter}-r{lineage}-v{version}" if lineage else f"{adapter}-v{version}"
    notice = _notice(
        name,
        version,
        adapter=adapter,
        lineage=lineage,
        kept=[_kept(f"{adapter}-v{v}", v) for v in range(version - 1, version - 1 - kept, -1)],
    )
    return target_of_notice(adapter, notice)


def test_every_adapter_and_every_kept_version_is_wanted_committed_ones_first() -> None:
    desired = DesiredState()
    desired.learn(_target("policy", 3, kept=2))
    desired.learn(_target("other", 7))

    assert [w.served_name for w in desired.wanted()] == [
        "other-v7",
        "policy-v3",
        "policy-v2",
        "policy-v1",
    ]
    assert desired.committed_names() == {"other-v7", "policy-v3"}
    assert [w.served_name for w in desired.missing(["policy-v3", "policy-v1"])] == [
        "other-v7",
        "policy-v2",
    ]


def test_an_adapter_only_moves_forward_and_a_later_lineage_wins_whatever_its_version() -> None:
    desired = DesiredState()
    assert desired.learn(_target("policy", 5))
    assert not desired.learn(_target("policy", 4)), "a replayed older commit"
    assert desired.learn(_target("policy", 5)), "the same commit, told again"
    assert desired.learn(_target("policy", 1, lineage=1)), "after a reset"
    assert not desired.learn(_target("policy", 9)), "a name of the lineage before"

    assert desired.targets["policy"].served_name == "policy-r1-v1"


def test_a_version_6_notice_goes_to_the_adapter_its_served_name_belongs_to() -> None:
    known = {"fixed": _target("fixed", 2)}
    known["fixed"] = msgspec.structs.replace(known["fixed"], served_name="fixed")

    assert adapter_of_notice(_notice("policy-v3", 3), known) == "policy"
    assert adapter_of_notice(_notice("policy-r2-v1", 1, lineage=2), known) == "policy"
    assert adapter_of_notice(_notice("fixed", 3), known) == "fixed", "known by its name"
    assert adapter_of_notice(_notice("plain", 3), {}) == "plain", "fixed naming"
    assert adapter_of_notice(_notice("x-v3", 3, adapter="named"), {}) == "named"


def test_a_version_6_notice_keeps_the_kept_versions_of_its_own_commit_only() -> None:
    desired = DesiredState()
    desired.learn(_target("policy", 2, kept=1))

    again = target_of_notice("policy", _notice("policy-v2", 2))
    desired.learn(again, kept_known=False)
    assert desired.names() == {"policy-v2", "policy-v1"}, "a term's announcement"

    newer = target_of_notice("policy", _notice("policy-v3", 3))
    desired.learn(newer, kept_known=False)
    assert desired.names() == {"policy-v3"}, "nothing known of what it keeps until a read"


def test_a_read_forgets_reset_adapters_but_not_those_learnt_since_it_began() -> None:
    desired = DesiredState()
    desired.learn(_target("policy", 1))
    desired.learn(_target("reset", 4))
    began = desired.learnings
    desired.learn(_target("newcomer", 1))  # a notice while the read ran
    assert "reset-v4" in desired.names()

    gone = desired.forget_unseen({"policy"}, learnt_before=began)

    assert gone == ["reset"]
    assert set(desired.targets) == {"policy", "newcomer"}
    # What was worked out before the read is not what the engine must hold now.
    assert desired.names() == {"policy-v1", "newcomer-v1"}
    assert desired.committed_names() == {"policy-v1", "newcomer-v1"}


def test_what_the_targets_imply_follows_each_target_learnt() -> None:
    desired = DesiredState("w1")
    desired.learn(_target("q", 2))
    held = ["p-v1", "q-v2"]
    assert desired.unplaced(held) == [] and desired.names() == {"q-v2"}

    # p is placed on w0 alone: w1 gives up what it holds of it.
    placed = msgspec.structs.replace(_target("p", 1), workers=("w0",))
    desired.learn(placed)
    assert desired.unplaced(held) == ["p-v1"] and desired.names() == {"q-v2"}

    # Then placed on w1 as well: required here, no longer given up.
    desired.learn(msgspec.structs.replace(_target("p", 2), workers=("w0", "w1")))
    assert desired.unplaced(held) == [] and desired.names() == {"p-v2", "q-v2"}


def test_a_record_of_another_wire_version_still_decodes_and_its_odd_kept_entries_are_skipped() -> (
    None
):
    record = CommittedRecord(
        adapter="policy",
        version=3,
        path="/adapters/policy-v3",
        served_name="policy-v3",
        rank_map=build_rank_map({"w0": 1}),
        kept=[_kept("policy-v2", 2)],
    )
    raw = msgspec.json.decode(msgspec.json.encode(record))
    raw["kept"].append({"version": 1, "digest": ""})  # version 6: no served name, no path
    view = COMMITTED_VIEW.decode(msgspec.json.encode(raw))

    target = target_of_record("policy", view)

    assert [w.served_name for w in target.wanted()] == ["policy-v3", "policy-v2"]
    assert target.wanted()[1].kept


def test_an_unready_reason_names_the_first_few_missing_and_counts_the_rest() -> None:
    missing = [
        Wanted(adapter=f"a{i:03}", served_name=f"a{i:03}-v1", path="/p", version=1)
        for i in range(200)
    ]
    failures = {"a150-v1": (3, "no such directory " + "x" * 10_000)}

    text = unready_text(missing, failures)

    assert len(text) <= 4096
    assert text.startswith("missing a150-v1 (adapter a150): loading it failed 3 times: no such")
    assert "missing a000-v1 (adapter a000)" in text
    assert text.endswith("and 196 more missing")
