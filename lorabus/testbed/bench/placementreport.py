"""The figures of the placement series, one :class:`PlacementResult` per fleet
size, and its three verdicts: no engine held more than its capacity, the
adapters spread within one of even, and stopping a worker moved only its
adapters (``placement.py`` says how each is measured)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from lorabus.testbed.bench.figures import Target


class PlacementResult(msgspec.Struct, kw_only=True):
    """T tenants' adapters on N workers of capacity C, R replicas each."""

    n: int
    tenants: int
    keep: int
    capacity: int
    """Each engine's ``--max-adapters``."""
    replicas: int
    """Workers each update placed its adapter on."""
    rounds: int
    """Updates of every tenant before the stop, and again after it."""
    committed: int
    failed: int
    peak_held: int
    """The most adapters any engine held at once, by its own list."""
    adapters_per_worker_min: int
    adapters_per_worker_max: int
    """Adapters placed per worker before the stop, by the fleet's status."""
    stopped: str
    """The worker stopped: the one with the most adapters placed on it."""
    adapters_on_stopped: int
    moved: list[str]
    """The adapters whose placement changed when it stopped."""
    moved_only_its_own: bool
    """Only the adapters on it moved, each to one other worker, the rest of
    their workers kept, and no other adapter's placement changed."""
    replace_s: float
    """From the stop until no adapter was placed on it (``--replace-after``
    and the liveness timeout included)."""
    elapsed_s: float
    errors: list[str] = []


def judge_placement(results: Sequence[PlacementResult]) -> list[Target]:
    """The series' verdicts at each fleet size (none when it did not run)."""
    targets: list[Target] = []
    for r in results:
        where = f"placement N={r.n} T={r.tenants} K={r.keep} C={r.capacity}"
        spread = r.adapters_per_worker_max - r.adapters_per_worker_min
        targets += [
            Target(
                target=f"{where}: no engine holds more than C adapters",
                measured=f"peak {r.peak_held} held; {r.failed} of "
                f"{r.committed + r.failed} updates failed",
                met=r.peak_held <= r.capacity and not r.failed,
            ),
            Target(
                target=f"{where}: adapters spread within one of even (R={r.replicas})",
                measured=f"{r.adapters_per_worker_min}-{r.adapters_per_worker_max} per worker",
                met=spread <= 1,
            ),
            Target(
                target=f"{where}: stopping a worker moves only its adapters",
                measured=f"{len(r.moved)} moved, {r.adapters_on_stopped} were on "
                f"{r.stopped}, in {r.replace_s:.1f}s",
                met=r.moved_only_its_own and len(r.moved) == r.adapters_on_stopped,
            ),
        ]
    return targets


def placement_table(results: Sequence[PlacementResult]) -> list[str]:
    if not results:
        return []
    lines = [
        "",
        "placement series (live mode; null engines of capacity C; one worker stopped):",
        f"{'N':>5} {'T':>4} {'K':>2} {'C':>3} {'R':>3} {'committed':>9} {'failed':>6} "
        f"{'peak':>4} {'per worker':>10} {'moved':>9} {'replace s':>9}",
    ]
    for r in results:
        per = f"{r.adapters_per_worker_min}-{r.adapters_per_worker_max}"
        moved = f"{len(r.moved)}/{r.adapters_on_stopped}"
        lines.append(
            f"{r.n:>5} {r.tenants:>4} {r.keep:>2} {r.capacity:>3} {r.replicas:>3} "
            f"{r.committed:>9} {r.failed:>6} {r.peak_held:>4} {per:>10} {moved:>9} "
            f"{r.replace_s:>9.1f}"
        )
    return lines
