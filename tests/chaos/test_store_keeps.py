"""The invariant ``store_keeps``: a digest that a record or an admitted request
kept throughout a listing of the adapter store must be in it; a race between
the reads of a sample is no violation.

Samples are built by hand: the check is a pure function of the timeline.
"""

from __future__ import annotations

from collections.abc import Sequence

from lorabus.adapters.bus_paths import bus_path
from lorabus.schemas import (
    CommittedRecord,
    ErrorCode,
    ErrorInfo,
    InflightRecord,
    KeptVersion,
    Phase,
    ResetRecord,
    UpdateResult,
    build_rank_map,
)
from lorabus.testbed.chaos import INVARIANTS, Bounds, Timeline, check_all
from lorabus.testbed.chaos.invariants import check_store_keeps
from lorabus.testbed.chaos.store_watch import record_names
from lorabus.testbed.chaos.timeline import StoreSample, UpdateRecord

D1, D2, D3 = ("sha256:" + c * 64 for c in "123")
BOUNDS = Bounds(pause_lease_s=4.0, grace_s=8.0, converge_s=10.0)


def commit_point(
    version: int, digest: str, kept: Sequence[tuple[int, str]] = ()
) -> CommittedRecord:
    return CommittedRecord(
        adapter="policy",
        version=version,
        path=bus_path(digest),
        served_name=f"policy-v{version}",
        rank_map=build_rank_map({"a": 1}),
        digest=digest,
        kept=[
            KeptVersion(version=v, served_name=f"policy-v{v}", path=bus_path(d)) for v, d in kept
        ],
    )


def in_flight(update_id: str, digest: str, phase: Phase = Phase.PAUSE) -> InflightRecord:
    return InflightRecord(
        update_id=update_id,
        epoch=1,
        phase=phase,
        adapter="policy",
        served_name="policy-v9",
        version=9,
        members={"a": 1},
        path=bus_path(digest),
    )


def sample(
    at: float,
    before: dict[str, frozenset[str]],
    stored: set[str],
    after: dict[str, frozenset[str]] | None = None,
) -> StoreSample:
    """Records read at ``at``, the store listed 0.1 s later, the records read again."""
    return StoreSample(
        began=at,
        listed_from=at + 0.1,
        listed_to=at + 0.2,
        ended=at + 0.3,
        before=before,
        after=before if after is None else after,
        stored=frozenset(stored),
    )


def names(
    *, committed: CommittedRecord | None = None, flight: InflightRecord | None = None
) -> dict[str, frozenset[str]]:
    return record_names({"policy": committed} if committed else {}, {}, [flight] if flight else [])


def request(
    update_id: str, digest: str, sent: float, answered: float, result: UpdateResult
) -> UpdateRecord:
    return UpdateRecord(
        update_id=update_id,
        version=9,
        path=bus_path(digest),
        requested_at=sent - 0.05,
        sent_at=sent,
        answered_at=answered,
        attempts=[result.status],
        result=result,
    )


def result(update_id: str, code: ErrorCode | None = None) -> UpdateResult:
    if code is None:
        return UpdateResult(update_id=update_id, status="committed", adapter="policy-v9", version=9)
    return UpdateResult(
        update_id=update_id,
        status="failed",
        adapter="policy-v9",
        version=9,
        error=ErrorInfo(code=code, message=str(code)),
    )


def test_a_version_kept_by_an_unchanged_commit_point_and_missing_is_a_violation() -> None:
    t = Timeline()
    kept = names(committed=commit_point(5, D2, kept=[(4, D1)]))
    t.store_samples.append(sample(10.0, kept, stored={D2}))

    [violation] = check_store_keeps(t)

    assert violation.invariant == "store_keeps" and violation.subject == D1
    assert "policy v4, kept by the commit point of policy v5" in violation.detail
    assert "listed from t+10.10s to t+10.20s (1 objects)" in violation.detail
    assert "store_keeps" in INVARIANTS and check_all(t, BOUNDS) == [violation]


def test_a_commit_that_let_the_version_go_between_the_reads_is_no_violation() -> None:
    """Read 1: v5 keeps D1. The leader commits v6 (dropping D1) and deletes
    D1; the listing misses it; read 2 shows v6. No record kept it throughout."""
    t = Timeline()
    t.store_samples.append(
        sample(
            10.0,
            names(committed=commit_point(5, D2, kept=[(4, D1)])),
            stored={D2, D3},
            after=names(committed=commit_point(6, D3, kept=[(5, D2)])),
        )
    )

    assert check_store_keeps(t) == []


def test_a_digest_named_again_by_another_record_in_the_second_read_is_no_violation() -> None:
    """The same bytes asked again after their deletion: the old commit point
    named D1 in read 1, a new update in flight names it in read 2 (pushed
    again meanwhile); neither kept it throughout."""
    t = Timeline()
    t.store_samples.append(
        sample(
            10.0,
            names(committed=commit_point(5, D2, kept=[(4, D1)])),
            stored={D2},
            after=names(committed=commit_point(6, D2), flight=in_flight("u7", D1)),
        )
    )

    assert check_store_keeps(t) == []


def test_an_update_in_flight_keeps_its_digest_whatever_phase_it_moves_to() -> None:
    t = Timeline()
    t.store_samples.append(
        sample(
            10.0,
            names(flight=in_flight("u7", D1, Phase.PAUSE)),
            stored=set(),
            after=names(flight=in_flight("u7", D1, Phase.LOAD)),
        )
    )

    [violation] = check_store_keeps(t)

    assert "update u7 in flight" in violation.detail


def test_an_admitted_request_in_flight_throughout_keeps_its_digest() -> None:
    t = Timeline()
    t.updates.append(request("u8", D3, sent=9.0, answered=12.0, result=result("u8")))
    t.store_samples.append(sample(10.0, {}, stored={D1}))

    [violation] = check_store_keeps(t)

    assert violation.subject == D3 and "request u8 (v9, sent at t+9.00s" in violation.detail


def test_a_request_refused_on_arrival_or_finished_before_the_sample_ended_keeps_nothing() -> None:
    t = Timeline()
    t.updates += [
        request("refused", D1, 9.0, 12.0, result("refused", ErrorCode.BAD_REQUEST)),
        request("superseded", D1, 9.0, 12.0, result("superseded", ErrorCode.SUPERSEDED)),
        request("later", D1, 10.05, 12.0, result("later")),
        request("finished", D1, 9.0, 12.0, result("finished", ErrorCode.PHASE_TIMEOUT)),
    ]
    t.finished_seen["finished"] = 10.25  # its answer came late; it had finished
    t.store_samples.append(sample(10.0, {}, stored=set()))

    assert check_store_keeps(t) == []


def test_a_lapse_over_several_samples_is_reported_once() -> None:
    t = Timeline()
    kept = names(committed=commit_point(5, D2, kept=[(4, D1)]))
    t.store_samples += [sample(at, kept, stored={D2}) for at in (10.0, 10.5, 11.0)]

    [violation] = check_store_keeps(t)

    assert "3 samples in all missed it, the last listed at t+11.10s" in violation.detail


def test_records_name_what_they_keep_and_a_path_on_a_filesystem_names_nothing() -> None:
    point = commit_point(5, D2, kept=[(4, D1)])
    carried = commit_point(6, D3, kept=[(5, D2)])
    flight = InflightRecord(
        update_id="u7",
        epoch=1,
        phase=Phase.LOAD,
        adapter="policy",
        served_name="policy-v6",
        version=6,
        members={"a": 1},
        path=bus_path(D3),
        committing=carried,
    )
    reset = ResetRecord(
        adapter="other",
        lineage=2,
        previous_version=3,
        previous_path=bus_path(D1),
        reason="bogus",
        ts=0.0,
        kept=[KeptVersion(version=3, served_name="policy-v3", path=bus_path(D1))],
    )
    on_disk = CommittedRecord(
        adapter="disk",
        version=1,
        path="/ckpt/step_1",
        served_name="disk-v1",
        rank_map=build_rank_map({"a": 1}),
        digest=D2,
    )

    found = record_names({"policy": point, "disk": on_disk}, {"other": reset}, [flight])
    by_digest: dict[str, list[str]] = {}
    for name, digests in found.items():
        for digest in digests:
            by_digest.setdefault(digest, []).append(name)

    assert sorted(by_digest) == [D1, D2, D3]
    assert any(
        n.startswith("policy v4, kept by the commit point of policy v5") for n in by_digest[D1]
    )
    assert any(n.startswith("other v3, kept by the reset of other") for n in by_digest[D1])
    assert any(n.startswith("policy v5, committed by the commit point") for n in by_digest[D2])
    assert any(n.startswith("policy v5, kept by the commit of policy v6") for n in by_digest[D2])
    assert not any("disk" in n for n in found)
    assert "update u7 in flight (policy v6)" in by_digest[D3]
    # A reset's kept versions count only while its adapter has no commit point.
    assert not any("reset" in n for n in record_names({"other": point}, {"other": reset}))
