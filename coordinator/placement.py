"""Placement: on which workers an update puts its adapter.

By default an adapter lives on every worker, as it always has. An update may
ask for fewer (``UpdateRequest.replicas``), or for workers whose announced
labels match a selector (``selector``: zone, engine, GPU type), or both. The
leader then chooses, among the live, ready workers the selector matches:

1. those with room for it (by their heartbeat's ``capacity``: what is
   placed there, the adapter's new version and the versions it keeps)
   before those without;
2. then the workers that serve the adapter now (its commit point's
   ``workers``), so that the next version lands where the last one is
   served: no cold load moves the adapter's traffic elsewhere;
3. then the least loaded: the fewest served names placed on them, so that
   many adapters of the same ``replicas`` spread within one of even;
4. ties broken by a hash of the adapter's and the worker's names
   (rendezvous hashing), so that every leader chooses alike.

Before it chooses, an update waits (up to ``--quorum-timeout``) for the
workers that serve the adapter now and have not left (silent less than
``--replace-after``), and, placed by a selector alone, for every live
worker that matches: a restarting worker is not dropped. One that reports
why it will not become ready (``unready_reason``) is not waited for. A
placement no remembered worker can meet (more replicas than workers, a
selector nothing matches) fails at once.

The update's quorum, phases, verify, frontend check and rank map are then
about the chosen workers only, and its commit point lists them: the agents
of the other workers do not load the adapter, and unload the versions of it
they hold. A worker that leaves is replaced (``replacement.py``): the
commit point is rewritten with another worker in its place, which loads
the adapter's versions from it as any agent converges.

Placement is per update: an update without ``replicas`` or a selector puts
its adapter on every worker again, and a worker that joins later gets a
selector's adapter at its next update.

Placement runs in live mode only: a pause-mode update pauses the fleet it
updates, and its shared pause rounds assume every worker.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import msgspec

from lorabus.schemas import CommittedRecord, Heartbeat


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """What an update asked for: how many workers, and which may serve."""

    replicas: int | None = None
    """How many (None: every worker the selector matches)."""
    selector: dict[str, str] = {}
    """Labels each one must announce ({}: any worker)."""

    @property
    def everywhere(self) -> bool:
        """Every worker, as an update without placement."""
        return self.replicas is None and not self.selector

    def describe(self) -> str:
        many = "every" if self.replicas is None else str(self.replicas)
        if not self.selector:
            return f"{many} worker(s)"
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))
        return f"{many} worker(s) labelled {labels}"


class Served(msgspec.Struct, frozen=True, array_like=True):
    """A served name the fleet has committed, and the workers placed to serve it."""

    name: str
    workers: tuple[str, ...] = ()
    """(): every worker."""

    def on(self, worker: str) -> bool:
        return not self.workers or worker in self.workers


def serving(committed: Iterable[CommittedRecord]) -> list[Served]:
    """What the fleet's commit points have engines serve: each adapter's
    committed version and the versions kept beside it, where placed."""
    found: dict[str, set[str] | None] = {}
    for record in committed:
        names = [record.served_name, *(k.served_name for k in record.kept if k.served_name)]
        for name in names:
            if not record.workers or found.get(name, set()) is None:
                found[name] = None
            else:
                found.setdefault(name, set()).update(record.workers)  # type: ignore[union-attr]
    return [Served(name, tuple(sorted(w)) if w else ()) for name, w in sorted(found.items())]


def needed_on(worker: str, own: Iterable[str], beside: Iterable[Served]) -> set[str]:
    """The names ``worker`` holds once it serves ``own`` (an adapter's new
    version and the versions it keeps) beside what is placed there."""
    return {s.name for s in beside if s.on(worker)} | set(own)


def eligible(selector: Mapping[str, str], beats: Mapping[str, Heartbeat]) -> list[str]:
    """The workers whose labels hold every label of ``selector``."""
    return sorted(
        worker
        for worker, beat in beats.items()
        if all(beat.labels.get(key) == value for key, value in selector.items())
    )


def place(
    adapter: str,
    placement: Placement,
    beats: Mapping[str, Heartbeat],
    *,
    now_on: Sequence[str],
    own: Sequence[str],
    beside: Sequence[Served],
    with_room_only: bool = False,
) -> list[str] | None:
    """The workers to serve ``adapter``, sorted, or None while too few are
    eligible. ``beats``: the live, ready workers' heartbeats; ``now_on``:
    the workers its commit point lists; ``own``: the adapter's names each
    one will hold; ``with_room_only``: never a worker without room for them."""
    current = set(now_on)

    def full(worker: str) -> bool:
        capacity = beats[worker].capacity
        return capacity is not None and len(needed_on(worker, own, beside)) > capacity

    def order(worker: str) -> tuple[bool, bool, int, bytes]:
        load = len(needed_on(worker, own, beside))
        return (full(worker), worker not in current, load, _rendezvous(adapter, worker))

    candidates = eligible(placement.selector, beats)
    if with_room_only:
        candidates = [w for w in candidates if not full(w)]
    wanted = len(candidates) if placement.replicas is None else placement.replicas
    if not candidates or len(candidates) < wanted:
        return None
    return sorted(sorted(candidates, key=order)[:wanted])


def _rendezvous(adapter: str, worker: str) -> bytes:
    return hashlib.blake2b(f"{adapter}\0{worker}".encode(), digest_size=8).digest()


def unplaceable(placement: Placement, beats: Mapping[str, Heartbeat], timeout_s: float) -> str:
    """Why no placement was found within ``timeout_s``."""
    found = len(eligible(placement.selector, beats))
    return (
        f"placement: {placement.describe()} asked for; {found} live, ready worker(s) "
        f"matched within {timeout_s:g} s"
    )


def never_placeable(placement: Placement, remembered: Mapping[str, Heartbeat]) -> str | None:
    """Why no worker the coordinator remembers (live or silent) could ever
    meet ``placement``, or None: such a request fails at once, not after a
    quorum timeout that would hold an update slot for nothing."""
    found = len(eligible(placement.selector, remembered))
    wanted = 1 if placement.replicas is None else placement.replicas
    if found >= wanted:
        return None
    return f"placement: {placement.describe()} asked for; the fleet has {found} such worker(s)"


def wait_for_whom(
    placement: Placement,
    live: Mapping[str, Heartbeat],
    now_on: Iterable[str],
    not_gone: Callable[[str], bool],
) -> list[str]:
    """The workers a placed update waits for before it chooses (see the
    module docstring): ``live`` are the live workers' heartbeats, ready or
    not; ``not_gone``: whether a worker has not left (silent less than
    ``--replace-after``)."""

    def coming(worker: str) -> bool:
        beat = live.get(worker)
        if beat is None:
            return not_gone(worker)
        matches = all(beat.labels.get(k) == v for k, v in placement.selector.items())
        return matches and not beat.ready and not beat.unready_reason

    waited = [w for w in now_on if coming(w)]
    if placement.replicas is None:
        waited += [w for w in eligible(placement.selector, live) if coming(w)]
    return sorted(set(waited))
