"""The invariant ``ready_after_restart``: a worker that says ready serves every adapter.

After its agent or its engine restarted, a worker's heartbeat may say ready
only while its engine lists every adapter's committed version and the
versions kept beside it. Judged on every ready heartbeat, against the
engine's own list (read in this process) when the heartbeat was seen.

What the agent must know is judged without a race. An agent process reads
the fleet's records when it starts, before its first heartbeat, and learns
of later commits from notices that may come late (a partition, a frozen
leader between its answer and its notice). So a heartbeat is held to what
was committed before its process started (:func:`~lorabus.testbed.chaos.
commits.requirement`): each adapter's newest commit known then (answered, or
its notice seen: its commit point was written before either) and the
versions its notice keeps beside it; less what a newer update of that
adapter, sent before the heartbeat was seen, would no longer keep (the agent
may have read it, and dropped what it lets go). A commit that lands just
as the heartbeat goes is never held against it. An engine restart (it loses
every adapter) is seen by the agent at its next look: a heartbeat whose own
list still shows the lost name, when the engine has not listed it since
its restart, was read back before the restart, and is not held against the
engine (its agent's next look is). A process started while its node was
cut off from the cluster may have read a node behind the others: it is not
judged.

Each (worker, agent process, served name) is reported once, at its first
heartbeat, with how many ready heartbeats lacked it.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from lorabus.testbed.chaos.commits import Commit, Requirement, commit_history, requirement
from lorabus.testbed.chaos.timeline import (
    AGENT_CUT_OFF,
    ENGINE_RESTART,
    ReadyBeat,
    Timeline,
    Window,
)
from lorabus.testbed.chaos.verdict import Violation


class _Engine:
    """One worker's engine list over the run, looked up by time."""

    def __init__(self, timeline: Timeline, worker_id: str) -> None:
        samples = timeline.adapters.get(worker_id, [])
        self._times = [at for at, _ in samples]
        self._sets = [names for _, names in samples]
        self._restarts = sorted(w.start for w in timeline.windows_of(worker_id, {ENGINE_RESTART}))

    def at(self, when: float) -> frozenset[str]:
        index = bisect_right(self._times, when)
        return self._sets[index - 1] if index else frozenset()

    def last_restart(self, when: float) -> float | None:
        index = bisect_right(self._restarts, when)
        return self._restarts[index - 1] if index else None

    def lost_to_restart(self, name: str, when: float) -> float | None:
        """The engine's last restart at or before ``when`` if it has not listed
        ``name`` since (a report that lists it was read before), else None."""
        restart = self.last_restart(when)
        if restart is None:
            return None
        first = bisect_right(self._times, restart)
        last = bisect_right(self._times, when)
        if any(name in names for names in self._sets[first:last]):
            return None
        return restart


@dataclass
class _Lack:
    beat: ReadyBeat
    started: float
    commit: Commit
    engine: frozenset[str]
    beats: int = 1


def check_ready_after_restart(timeline: Timeline) -> list[Violation]:
    found, _ = _judge(timeline)
    return [
        _violation(timeline, worker_id, name, lack) for (worker_id, _, name), lack in found.items()
    ]


def restart_coverage(timeline: Timeline) -> dict[str, int]:
    """How much the check judged: agent processes held to something committed
    before they started, their ready heartbeats, and (heartbeat, served name)
    pairs looked up on the engine; with the engine restarts among them."""
    _, judged = _judge(timeline)
    return judged


def _judge(timeline: Timeline) -> tuple[dict[tuple[str, str, str], _Lack], dict[str, int]]:
    found: dict[tuple[str, str, str], _Lack] = {}
    judged = {"processes": 0, "ready_heartbeats": 0, "names_checked": 0, "engine_restarts": 0}
    history = commit_history(timeline)
    if not history:
        return found, judged
    for worker_id, beats in sorted(timeline.ready_beats.items()):
        engine = _Engine(timeline, worker_id)
        cut_off = timeline.windows_of(worker_id, {AGENT_CUT_OFF})
        processes: dict[str, tuple[float, list[Requirement]] | None] = {}
        restarts: set[float] = set()
        for beat in beats:
            if beat.instance not in processes:
                started = timeline.instance_start(worker_id, beat.instance)
                processes[beat.instance] = _held_to(history, started, cut_off)
                judged["processes"] += processes[beat.instance] is not None
            process = processes[beat.instance]
            if process is None:
                continue
            started, needs = process
            serving = engine.at(beat.at)
            checked = [n for need in needs for n in need.names(beat.at)]
            if checked:
                judged["ready_heartbeats"] += 1
                judged["names_checked"] += len(checked)
                restart = engine.last_restart(beat.at)
                if restart is not None and restart >= started:
                    restarts.add(restart)
            for need in needs:
                assert need.base is not None
                for name in sorted(need.names(beat.at) - serving):
                    if name in beat.adapters and engine.lost_to_restart(name, beat.at) is not None:
                        continue  # the agent has not looked since its engine restarted
                    key = (worker_id, beat.instance, name)
                    if key in found:
                        found[key].beats += 1
                    else:
                        found[key] = _Lack(beat, started, need.base, serving)
        judged["engine_restarts"] += len(restarts)
    return found, judged


def _held_to(
    history: dict[str, list[Commit]], started: float | None, cut_off: list[Window]
) -> tuple[float, list[Requirement]] | None:
    """What an agent process that started at ``started`` is held to, per
    adapter (None: nothing, or it may have read a node behind the others)."""
    if started is None or any(w.overlaps(started, started) for w in cut_off):
        return None
    needs = [requirement(commits, started) for commits in history.values()]
    needs = [n for n in needs if n.base is not None]
    return (started, needs) if needs else None


def _violation(timeline: Timeline, worker_id: str, name: str, lack: _Lack) -> Violation:
    commit, beat = lack.commit, lack.beat
    what = "committed" if name == commit.served_name else f"kept beside {commit.served_name}"
    restarts = [
        w.start
        for w in timeline.windows_of(worker_id, {ENGINE_RESTART})
        if lack.started <= w.start <= beat.at
    ]
    why = (
        f"its engine restarted at {timeline.at(max(restarts))}"
        if restarts
        else "no engine restart since its agent started"
    )
    reported = (
        "lists it" if name in beat.adapters else f"lists {sorted(beat.adapters)}, not it either"
    )
    also = f"; {lack.beats} ready heartbeats of that process lacked it" if lack.beats > 1 else ""
    return Violation(
        invariant="ready_after_restart",
        subject=worker_id,
        detail=f"its agent (started at {timeline.at(lack.started)}) said ready at "
        f"{timeline.at(beat.at)} while its engine listed {sorted(lack.engine)}, without "
        f"{name} ({what} by update {commit.update_id}, known committed at "
        f"{timeline.at(commit.known_at)}, before that agent started; {why}); its heartbeat "
        f"{reported}{also}",
        adapter=commit.adapter,
    )
