"""A simulated worker remembers its recent requests only, so long runs stay small."""

from __future__ import annotations

from lorabus.simfleet import RecordedRequest, SimWorker
from lorabus.simfleet.state import REQUEST_LOG_LIMIT


def _request(n: int) -> RecordedRequest:
    return RecordedRequest(method="GET", path=f"/v1/loras?n={n}", headers={}, body=None, ts=n)


async def test_the_request_log_keeps_the_newest_requests_and_counts_them_all() -> None:
    worker = SimWorker("w0", 1)
    total = 3 * REQUEST_LOG_LIMIT
    for n in range(total):
        worker.record(_request(n))

    assert REQUEST_LOG_LIMIT <= len(worker.requests) <= REQUEST_LOG_LIMIT * 5 // 4
    assert worker.requests[-1].path == f"/v1/loras?n={total - 1}"
    assert [r.ts for r in worker.requests] == list(range(total - len(worker.requests), total))
    assert worker.requests_total == total
    assert await worker.wait_requests(total)
