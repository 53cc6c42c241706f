"""The coordinator's book: few results in memory but never the only copy, one
content per update id, a bounded queue that answers what it need not keep.

The same rules run end to end against a real coordinator in
``test_request_reuse.py`` and ``test_request_queue.py``."""

from __future__ import annotations

import asyncio
import posixpath

from lorabus.coordinator.book import UpdateBook
from lorabus.coordinator.plan import CheckedRequest
from lorabus.schemas import (
    COMMITTED,
    CommittedRecord,
    ErrorCode,
    RankMap,
    UpdateRequest,
    UpdateResult,
)


def _request(
    update_id: str, *, adapter: str = "policy", path: str = "/adapters/policy", version: int | None
) -> UpdateRequest:
    return UpdateRequest(update_id=update_id, adapter=adapter, path=path, version=version)


def _queued(
    update_id: str, *, adapter: str = "policy", path: str = "/adapters/policy", version: int | None
) -> CheckedRequest:
    return _checked(_request(update_id, adapter=adapter, path=path, version=version))


def _checked(request: UpdateRequest) -> CheckedRequest:
    """A request as the coordinator queues it, checked on arrival."""
    path = posixpath.normpath(request.path)
    return CheckedRequest(request=request, path=path, live=False, replace=False, keep=2)


def _result(update_id: str, version: int = 1) -> UpdateResult:
    return UpdateResult(
        update_id=update_id, status=COMMITTED, adapter=f"policy-v{version}", version=version
    )


def _code(future: asyncio.Future[UpdateResult]) -> str | None:
    assert future.done()
    error = future.result().error
    return None if error is None else str(error.code)


async def test_old_results_are_left_to_the_results_bucket() -> None:
    book = UpdateBook()
    for i in range(100):
        book.finish(_request(f"u{i}", version=1), _result(f"u{i}"))

    assert not book.knows("u0"), "answered from the results bucket instead"
    assert book.knows("u99")


async def test_a_result_the_bucket_did_not_take_is_kept_for_the_term() -> None:
    book = UpdateBook()
    book.finish(_request("lost-write", version=1), _result("lost-write"), persisted=False)
    for i in range(100):
        book.finish(_request(f"u{i}", version=1), _result(f"u{i}"))

    assert book.knows("lost-write")
    again = book.submit(_queued("lost-write", version=1))
    assert again.done() and again.result() == _result("lost-write")


async def test_a_repeated_id_with_other_content_is_refused_naming_the_first() -> None:
    book = UpdateBook()
    first = _request("step-1", path="/adapters/step_1", version=1)
    book.finish(first, _result("step-1"))

    for other in (
        _request("step-1", path="/adapters/step_1", version=2),
        _request("step-1", path="/adapters/step_2", version=1),
        _request("step-1", adapter="critic", path="/adapters/step_1", version=1),
    ):
        answer = book.submit(_checked(other))
        assert _code(answer) == ErrorCode.BAD_REQUEST, other
        message = answer.result().error.message  # type: ignore[union-attr]
        assert "'policy' version 1 from /adapters/step_1" in message, message
    same = book.submit(_queued("step-1", path="/adapters/step_1/", version=1))
    assert same.result() == _result("step-1"), "a normalised path is the same directory"
    assert book.submit(_checked(first)).result() == _result("step-1"), "the refusals kept nothing"


async def test_without_a_version_a_request_asks_for_what_its_first_was_taken_as() -> None:
    book = UpdateBook()
    book.finish(_request("auto", version=None), _result("auto", version=3))
    explicit_first = _request("fixed", version=3)
    book.finish(explicit_first, _result("fixed", version=3))

    assert book.submit(_queued("auto", version=None)).result() == _result("auto", 3)
    assert book.submit(_queued("auto", version=3)).result() == _result("auto", 3)
    assert _code(book.submit(_queued("auto", version=4))) == ErrorCode.BAD_REQUEST
    assert book.submit(_queued("fixed", version=None)).result() == _result("fixed", 3)


async def test_a_version_is_checked_once_a_first_request_without_one_has_run() -> None:
    book = UpdateBook()
    first = book.submit(_queued("auto", version=None))
    as_three = book.submit(_queued("auto", version=3))
    as_four = book.submit(_queued("auto", version=4))
    elsewhere = book.submit(_queued("auto", path="/adapters/other", version=3))
    assert not as_three.done() and not as_four.done()
    assert _code(elsewhere) == ErrorCode.BAD_REQUEST, "the path is known before it runs"

    running = await book.next_request()
    book.finish(running.request, _result("auto", version=3))

    assert await first == await as_three == _result("auto", 3)
    await as_four
    assert _code(as_four) == ErrorCode.BAD_REQUEST
    assert "run as version 3" in as_four.result().error.message  # type: ignore[union-attr]


async def test_a_stored_result_stands_for_a_first_request_the_book_never_saw() -> None:
    committed = CommittedRecord(
        adapter="policy",
        version=1,
        path="/adapters/step_1",
        served_name="policy-v1",
        rank_map=RankMap(world_size=1, membership_version="m", entries=[]),
    )
    stored = _result("step-1")

    def look_up(request: UpdateRequest) -> asyncio.Future[UpdateResult] | None:
        return UpdateBook().look_up(request, stored=stored, committed=committed)

    same = look_up(_request("step-1", path="/adapters/step_1", version=1))
    assert same is not None and same.result() == stored
    for other in (
        _request("step-1", path="/adapters/step_2", version=1),
        _request("step-1", path="/adapters/step_1", version=2),
        _request("step-1", adapter="critic", path="/adapters/step_1", version=1),
    ):
        refused = look_up(other)
        assert refused is not None and _code(refused) == ErrorCode.BAD_REQUEST, other
    no_version = look_up(_request("step-1", path="/adapters/step_1", version=None))
    assert no_version is not None and no_version.result() == stored


async def test_past_max_queued_total_a_request_is_answered_busy_and_not_kept() -> None:
    book = UpdateBook(max_queued_total=2)
    running = await _run_one(book)
    queued = [book.submit(_queued(f"a{i}", adapter=f"a{i}", version=1)) for i in range(2)]
    refused = book.submit(_queued("late", adapter="late", version=1))

    assert _code(refused) == ErrorCode.BUSY
    error = refused.result().error
    assert error is not None and "--max-queued-total" in error.message
    assert not any(f.done() for f in queued)
    assert not book.knows("late"), "busy is no result: the id may come again"
    assert book.submit(_queued("a0", adapter="a0", version=1)) is queued[0], "re-asks are free"
    book.finish(running.request, _result("running"))
    await book.next_request()
    assert not book.submit(_queued("late", adapter="late", version=1)).done()


async def test_past_max_queued_of_one_adapter_only_that_adapter_is_busy() -> None:
    """The bound per adapter: a trainer that floods its own adapter fills its
    own queue, not the fleet's."""
    book = UpdateBook(max_queued=2, max_queued_total=10)
    await _run_one(book)
    mine = [book.submit(_queued(f"p{i}", version=None, path=f"/a/{i}")) for i in range(2)]
    refused = book.submit(_queued("p-late", version=None, path="/a/late"))
    other = book.submit(_queued("o1", adapter="other", version=1))

    assert _code(refused) == ErrorCode.BUSY
    error = refused.result().error
    assert error is not None and "'policy'" in error.message and "per adapter" in error.message
    assert not any(f.done() for f in [*mine, other]), "other adapters still queue"


async def test_updates_of_different_adapters_start_together_and_one_adapters_in_order() -> None:
    book = UpdateBook(max_running=3)
    for update_id, adapter in [("p1", "policy"), ("p2", "policy"), ("o1", "other")]:
        request = _request(update_id, adapter=adapter, version=None, path=f"/a/{update_id}")
        book.submit(
            CheckedRequest(request=request, path=request.path, live=True, replace=False, keep=2)
        )

    first = await book.next_request()
    second = await asyncio.wait_for(book.next_request(), 1.0)
    assert (first.update_id, second.update_id) == ("p1", "o1"), "p2 waits for p1, o1 does not"
    assert [c.update_id for c in book.running_updates()] == ["p1", "o1"]
    assert sorted(book.held_paths()) == ["/a/o1", "/a/p1", "/a/p2"]

    waiting = asyncio.ensure_future(book.next_request())
    await asyncio.sleep(0)
    assert not waiting.done(), "policy's next update starts only once p1 ends"
    book.finish(first.request, _result("p1"))
    assert (await asyncio.wait_for(waiting, 1.0)).update_id == "p2"


def _paused(update_id: str, adapter: str) -> CheckedRequest:
    request = _request(update_id, adapter=adapter, version=1)
    return CheckedRequest(request=request, path="/a", live=False, replace=False, keep=2)


async def test_pause_mode_requests_queued_together_start_as_one_round() -> None:
    """A round shares one pause of the fleet: each of its updates names the
    others. One that comes during the round waits until the whole round has
    ended, so the engines resume between rounds; a live one goes by."""
    book = UpdateBook(max_running=8)
    first = [_paused(f"x{i}", f"x{i}") for i in range(3)]
    for checked in first:
        book.submit(checked)

    started = [(await book.next_request()).update_id for _ in range(3)]
    assert started == ["x0", "x1", "x2"]
    assert book.round_of("x1") == ["x0", "x2"]
    late = _paused("y0", "y")
    book.submit(late)
    live = CheckedRequest(
        request=_request("l1", adapter="l", version=1), path="/a", live=True, replace=False, keep=2
    )
    book.submit(live)
    assert (await asyncio.wait_for(book.next_request(), 1.0)).update_id == "l1"
    waiting = asyncio.ensure_future(book.next_request())
    for checked in first[:2]:
        book.finish(checked.request, _result(checked.update_id))
    await asyncio.sleep(0)
    assert not waiting.done(), "y0 waits for the whole round to end"
    book.finish(first[2].request, _result("x2"))
    assert (await asyncio.wait_for(waiting, 1.0)).update_id == "y0"
    assert book.round_of("y0") == []


async def test_at_most_max_running_run() -> None:
    book = UpdateBook(max_running=2)
    paused = [_paused(f"x{i}", f"x{i}") for i in range(3)]
    for checked in paused:
        book.submit(checked)

    assert [(await book.next_request()).update_id for _ in range(2)] == ["x0", "x1"]
    assert book.round_of("x0") == ["x1"], "a round is as large as may run"
    third = asyncio.ensure_future(book.next_request())
    await asyncio.sleep(0)
    assert not third.done(), "two run already: max_running"
    book.finish(paused[0].request, _result("x0"))
    await asyncio.sleep(0)
    assert not third.done(), "x2 is not of the round: it waits for x1 too"
    book.finish(paused[1].request, _result("x1"))
    assert (await asyncio.wait_for(third, 1.0)).update_id == "x2"


async def test_supersession_is_answered_on_arrival_both_ways() -> None:
    book = UpdateBook()
    await _run_one(book)
    five = book.submit(_queued("v5", version=5))
    four = book.submit(_queued("v4", version=4))
    assert _code(four) == ErrorCode.SUPERSEDED, "older than a queued one: answered at once"
    assert not five.done()

    seven = book.submit(_queued("v7", version=7))
    assert _code(five) == ErrorCode.SUPERSEDED, "a newer one answers the queued older one"
    assert book.queued == 1 and not seven.done()
    assert sorted(r.update_id for r in book.take_settled()) == ["v4", "v5"]
    assert book.take_settled() == []


async def _run_one(book: UpdateBook) -> CheckedRequest:
    """Make the book busy with a running update, so that others queue."""
    book.submit(_queued("running", adapter="running", version=1))
    return await book.next_request()


async def test_a_stored_result_carries_its_path_once_the_version_is_no_longer_committed() -> None:
    """After a failover the book knows a first request only from its stored
    result: its path is checked even when another version is committed now
    (or none, after a reset), and a served name of a later lineage matches."""
    stored = UpdateResult(
        update_id="step-3",
        status=COMMITTED,
        adapter="policy-r1-v3",
        version=3,
        path="/adapters/step_3",
    )

    def look_up(request: UpdateRequest) -> asyncio.Future[UpdateResult] | None:
        return UpdateBook().look_up(request, stored=stored, committed=None)

    same = look_up(_request("step-3", path="/adapters/step_3", version=3))
    other_path = look_up(_request("step-3", path="/adapters/step_4", version=3))

    assert same is not None and same.result() == stored
    assert other_path is not None and _code(other_path) == ErrorCode.BAD_REQUEST
    assert "/adapters/step_3" in other_path.result().error.message  # type: ignore[union-attr]


async def test_a_new_leaders_first_round_waits_for_its_predecessors_requesters() -> None:
    """After a failover the requesters ask again within a re-ask interval:
    the first to come back must not start a round alone while the others
    are still on their way. A live request goes by at once."""
    book = UpdateBook(max_running=8)
    loop = asyncio.get_running_loop()
    book.rounds_from = loop.time() + 0.2
    book.submit(_paused("x0", "x0"))
    live = CheckedRequest(
        request=_request("l1", adapter="l", version=1), path="/a", live=True, replace=False, keep=2
    )
    book.submit(live)
    assert (await asyncio.wait_for(book.next_request(), 1.0)).update_id == "l1"
    waiting = asyncio.ensure_future(book.next_request())
    await asyncio.sleep(0.05)
    book.submit(_paused("x1", "x1"))  # asked again a moment later
    await asyncio.sleep(0)
    assert not waiting.done(), "no round before rounds_from"

    first = await asyncio.wait_for(waiting, 1.0)
    assert loop.time() >= book.rounds_from
    assert first.update_id == "x0" and book.round_of("x0") == ["x1"]
