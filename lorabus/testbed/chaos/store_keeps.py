"""The invariant ``store_keeps``, judged on the store samples of a timeline.

At every moment, every digest named by a committed or kept version, or by a
request admitted and not finished, is in the fleet's object store. The
samples (:mod:`lorabus.testbed.chaos.store_watch`) read the records, list
the store, and read the records again; reads that are not one instant race
with the leader's writes, so a digest counts as missing only when it was
kept throughout the listing:

- by a record: the same record (unchanged) keeps it in both reads around
  the listing;
- by a request of the run's own: sent before the sample began, its end
  after the sample ended, and admitted. Its end is when its finish was
  first seen on the bus (a terminal ``update_finished`` event) or its
  terminal answer arrived, whichever came first. Admission is not seen from
  outside: a request counts as admitted when its terminal result is one an
  update that was queued or ran can have (committed, or failed with a code
  other than those answered on arrival: ``bad_request``, as for an object
  not in the store, ``stale_version``, ``busy``; nor ``superseded``, which
  a request can be answered on arrival too). A request with no terminal
  result is judged by ``terminal_result`` instead.

Each digest missing is reported once per (digest, what named it), with the
first sample that caught it and how many did.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lorabus.adapters.bus_paths import digest_of
from lorabus.schemas import ErrorCode, UpdateResult
from lorabus.testbed.chaos.timeline import StoreSample, Timeline, UpdateRecord

ANSWERED_ON_ARRIVAL = frozenset(
    {
        ErrorCode.BAD_REQUEST,
        ErrorCode.STALE_VERSION,
        ErrorCode.BUSY,
        ErrorCode.SUPERSEDED,
        ErrorCode.TIMEOUT,
        ErrorCode.NO_COORDINATOR,
        ErrorCode.NOT_LEADER,
    }
)
"""Failed results that do not show the request was ever admitted (the last
three are the requester's own, not final)."""


_RECORD_ADAPTER = re.compile(r"^(?:update \S+ in flight \()?(\S+) v\d+")
"""The adapter a record's name (store_watch.record_names) starts with."""


@dataclass(frozen=True)
class _Request:
    digest: str
    sent: float
    end: float
    name: str
    adapter: str


def store_lapses(timeline: Timeline) -> list[tuple[str, str, str]]:
    """Every digest a record or an admitted request kept while a listing of
    the store did not hold it, as (digest, what happened, the adapter of
    what kept it)."""
    requests = _admitted_requests(timeline)
    adapters = {r.name: r.adapter for r in requests}
    caught: dict[tuple[str, str], list[StoreSample]] = {}
    for sample in timeline.store_samples:
        for digest, names in sorted(_kept_throughout(sample, requests).items()):
            if digest in sample.stored:
                continue
            for name in names:
                caught.setdefault((digest, name), []).append(sample)
    lapses = []
    for (digest, name), samples in caught.items():
        first, last = samples[0], samples[-1]
        also = (
            f"; {len(samples)} samples in all missed it, the last listed at "
            f"{timeline.at(last.listed_from)}"
            if len(samples) > 1
            else ""
        )
        named = _RECORD_ADAPTER.match(name)
        adapter = adapters.get(name) or (named.group(1) if named else "")
        lapses.append(
            (
                digest,
                f"{digest} is not in the store listed from {timeline.at(first.listed_from)} "
                f"to {timeline.at(first.listed_to)} ({len(first.stored)} objects), while "
                f"{name} kept it throughout (records read at {timeline.at(first.began)} "
                f"and again until {timeline.at(first.ended)}){also}",
                adapter,
            )
        )
    return lapses


def _kept_throughout(sample: StoreSample, requests: list[_Request]) -> dict[str, list[str]]:
    """Digest -> what kept it from before the listing began to after it ended."""
    kept: dict[str, list[str]] = {}
    for name, digests in sorted(sample.before.items()):
        for digest in sorted(digests & sample.after.get(name, frozenset())):
            kept.setdefault(digest, []).append(name)
    for request in requests:
        if request.sent < sample.began and request.end > sample.ended:
            kept.setdefault(request.digest, []).append(request.name)
    return kept


def _admitted_requests(timeline: Timeline) -> list[_Request]:
    requests = []
    for update in timeline.updates:
        digest = _digest(update)
        result, answered = update.result, update.answered_at
        if digest is None or update.sent_at is None or result is None or answered is None:
            continue
        if not admitted(result):
            continue
        seen = timeline.finished_seen.get(update.update_id)
        end = answered if seen is None else min(answered, seen)
        outcome = result.status if result.error is None else f"{result.status} {result.error.code}"
        requests.append(
            _Request(
                digest=digest,
                sent=update.sent_at,
                end=end,
                name=f"request {update.update_id} (v{update.version}, sent at "
                f"{timeline.at(update.sent_at)}, finished at {timeline.at(end)}: {outcome})",
                adapter=update.adapter,
            )
        )
    return requests


def admitted(result: UpdateResult) -> bool:
    """Whether a terminal result shows that its request was admitted (queued or run)."""
    return result.error is None or result.error.code not in ANSWERED_ON_ARRIVAL


def _digest(update: UpdateRecord) -> str | None:
    try:
        return digest_of(update.path)
    except ValueError:
        return None
