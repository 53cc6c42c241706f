"""The coordinator's book keeps few results in memory, but never the only copy."""

from __future__ import annotations

from lorabus.coordinator.book import UpdateBook
from lorabus.schemas import COMMITTED, UpdateRequest, UpdateResult


def _request(update_id: str) -> UpdateRequest:
    return UpdateRequest(update_id=update_id, adapter="policy", path="/adapters/policy")


def _result(update_id: str) -> UpdateResult:
    return UpdateResult(update_id=update_id, status=COMMITTED, adapter="policy-v1", version=1)


async def test_old_results_are_left_to_the_results_bucket() -> None:
    book = UpdateBook()
    for i in range(100):
        book.finish(_request(f"u{i}"), _result(f"u{i}"))

    assert not book.knows("u0"), "answered from the results bucket instead"
    assert book.knows("u99")


async def test_a_result_the_bucket_did_not_take_is_kept_for_the_term() -> None:
    book = UpdateBook()
    book.finish(_request("lost-write"), _result("lost-write"), persisted=False)
    for i in range(100):
        book.finish(_request(f"u{i}"), _result(f"u{i}"))

    assert book.knows("lost-write")
    again = book.submit(_request("lost-write"))
    assert again.done() and again.result() == _result("lost-write")
