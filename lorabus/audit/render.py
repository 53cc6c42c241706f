"""Human-readable text for results, rank maps, fleet status and what the
agents' heartbeats show (CLI output only; a trail record's line is
:func:`lorabus.audit.tap.timeline_line`).

Text that came off the wire (subjects, worker ids, error messages) goes
through :func:`printable` before it reaches a terminal.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lorabus.schemas import (
    FleetStatus,
    MemberStatus,
    Phase,
    RankMap,
    UpdateResult,
    WorkerRole,
)

if TYPE_CHECKING:
    from lorabus.audit.heartbeat_view import HeartbeatView

_PHASE_ORDER = [p.value for p in Phase]


def printable(text: str) -> str:
    """``text`` with every character that is not printable escaped as Python
    would (``\\x1b``, ``\\n``, ``\\u202e``), so that nothing a message carries can
    move the cursor, recolour, or rewrite what a terminal shows."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def phase_timeline(result: UpdateResult) -> str:
    parts = []
    for name in _PHASE_ORDER:
        if name not in result.phases:
            continue
        part = f"{name} {result.phases[name] * 1000:.0f}ms"
        if name == Phase.LOAD and result.load_s > result.phases[name]:
            # Carried by the pause: the engines' own load ran inside it.
            part = f"load {result.load_s * 1000:.0f}ms (in the pause)"
        parts.append(part)
    return " | ".join(parts)


def result_text(result: UpdateResult) -> str:
    total = sum(result.phases.values())
    lines = [
        f"{result.status.upper()}  {result.adapter} (version {result.version}) "
        f"update {result.update_id} in {total:.2f}s",
        f"  phases: {phase_timeline(result) or '-'}",
    ]
    if result.error is not None:
        lines.append(f"  error [{result.error.code}]: {result.error.message}")
    for worker_id, outcome in result.workers.items():
        if outcome.error is not None:
            lines.append(f"  {worker_id}: [{outcome.error.code}] {outcome.error.message}")
    if result.trimmed:
        lines.append(f"  {_trimmed_note(result.trimmed)}")
    if result.rank_map is not None:
        lines.extend(rank_map_text(result.rank_map, indent="  ").splitlines())
    return "\n".join(printable(line) for line in lines)


def _trimmed_note(trimmed: Sequence[str]) -> str:
    return f"left out to fit the bus's message size limit: {', '.join(trimmed)}"


def update_progress_text(update_id: str, status: FleetStatus | None) -> str:
    """One line on where update ``update_id`` stands, from the fleet's status
    (``None``: no coordinator answered the status request)."""
    if status is None:
        line = "no coordinator answers status requests right now; still asking for the result"
    elif status.in_flight is None:
        line = "waiting for a coordinator to run it"
    elif status.in_flight != update_id:
        line = _beside_others(update_id, status)
    elif status.in_flight_phase is None:
        line = (
            f"quorum: live world size {status.live_world_size} of "
            f"{status.expected_world_size} ({len(status.members)} member(s) live)"
        )
    elif "phase_members" in status.trimmed:
        line = f"{status.in_flight_phase} (who has acked: {_trimmed_note(['phase_members'])})"
    else:
        acked = len(status.acked)
        line = f"{status.in_flight_phase}: {acked} of {acked + len(status.waiting)} acked"
        if status.waiting:
            line += "; waiting for " + _names(status.waiting)
    return printable(f"update {update_id}: {line}")


def _beside_others(update_id: str, status: FleetStatus) -> str:
    """Where an update stands that is not the one running longest: running
    beside it (another adapter's), or queued."""
    running = {update.update_id: update for update in status.running}
    if update_id in running:
        phase = running[update_id].phase or "quorum"
        return f"{phase} (beside {len(running) - 1} other update(s) running)"
    ids = list(running) or [status.in_flight or ""]
    return f"queued behind update {_names(ids)}"


def _names(names: Sequence[str], shown: int = 8) -> str:
    """``names``, cut to ``shown`` of them so one line stays one line."""
    head = ", ".join(names[:shown])
    return head if len(names) <= shown else f"{head} and {len(names) - shown} more"


def rank_map_text(rank_map: RankMap, indent: str = "") -> str:
    lines = [
        f"{indent}rank map: group world size {rank_map.world_size} "
        f"(trainer = rank 0, membership {rank_map.membership_version})"
    ]
    for entry in rank_map.entries:
        last = entry.rank_offset + entry.world_size - 1
        line = (
            f"{indent}  {entry.worker_id:<12} world size {entry.world_size:>2}  "
            f"ranks {entry.rank_offset}-{last}"
        )
        if entry.role != WorkerRole.AGGREGATED:
            line += f"  {entry.role}"
        if entry.data_parallel > 1:
            per = entry.world_size // entry.data_parallel
            line += f"  {entry.data_parallel} data-parallel ranks of {per}"
        lines.append(line)
    return "\n".join(printable(line) for line in lines)


def age_text(seconds: float) -> str:
    """A duration as a person reads an age: ``45s``, ``12m``, ``3h``, ``2d``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


HOLDERS_SHOWN = 8
"""Worker ids an adapter's line names at most: at a thousand members, the
count says it, and the few that lack it are named instead."""


def adapters_text(status: FleetStatus, *, now: float) -> list[str]:
    """A line per committed adapter: its served name, version, digest (short),
    when it was committed (``now``: the Unix time to count from), which live
    members hold it, and the versions kept beside it."""
    if not status.adapters:
        return []
    lines = [f"adapters ({len(status.adapters)}):"]
    live = [m.worker_id for m in status.members]
    for a in status.adapters:
        digest = a.digest[: len("sha256:") + 12] if a.digest else "no digest"
        when = f"committed {age_text(now - a.committed_at)} ago" if a.committed_at else ""
        line = f"  {a.adapter}: {a.served_name} (version {a.version}, {digest})"
        line += f"{', ' + when if when else ''}; {_holders_text(a.holders, live, status.trimmed)}"
        if a.placed:  # (the holders' trimming leaves it out too)
            line += f"; placed on {len(a.placed)}: {_names(a.placed, HOLDERS_SHOWN)}"
        if a.kept:
            line += f"; kept beside it: {', '.join(a.kept)}"
        lines.append(line)
    return lines


def _holders_text(holders: Sequence[str], live: Sequence[str], trimmed: Sequence[str]) -> str:
    if "holders" in trimmed:
        return "holders left out (message size limit)"
    if live and len(holders) == len(live):
        return f"held by all {len(live)} live members"
    held = f"held by {len(holders)} of {len(live)} live members"
    if 0 < len(holders) <= HOLDERS_SHOWN:
        return f"{held}: {', '.join(holders)}"
    lacking = sorted(set(live) - set(holders))
    if lacking and len(lacking) <= HOLDERS_SHOWN:
        return f"{held} (not by {', '.join(lacking)})"
    return held


def status_text(status: FleetStatus, *, now: float | None = None) -> str:
    """The fleet's status for a terminal (``now``: the Unix time that the
    commits' ages count from; the system clock's by default)."""
    committed = (
        f"{status.committed_adapter} (version {status.committed_version})"
        if status.committed_adapter
        else "nothing yet"
    )
    lines = [
        f"fleet {status.fleet}: live world size {status.live_world_size} of "
        f"{status.expected_world_size} expected; committed: {committed}",
        f"leader {status.leader or '-'} (epoch {status.epoch})",
    ]
    if status.in_flight:
        progress = ""
        if status.in_flight_phase and "phase_members" in status.trimmed:
            progress = f": {status.in_flight_phase}"
        elif status.in_flight_phase:
            total = len(status.acked) + len(status.waiting)
            waiting = f" (waiting for {', '.join(status.waiting)})" if status.waiting else ""
            progress = f": {status.in_flight_phase}, {len(status.acked)}/{total} acked{waiting}"
        lines.append(f"update in flight: {status.in_flight}{progress}")
        others = [
            f"{update.update_id} ({update.adapter}, {update.phase or 'quorum'})"
            for update in status.running
            if update.update_id != status.in_flight
        ]
        if others:
            lines.append(f"also running: {_names(others)}")
    if status.trimmed:
        lines.append(_trimmed_note(status.trimmed))
    lines.extend(adapters_text(status, now=time.time() if now is None else now))
    lines.extend(_member_table(status.members))
    lines.extend(member_warnings(status.members, update_in_flight=status.in_flight is not None))
    for c in status.conflicts:
        lines.append(
            f"CONFLICT: worker id {c.worker_id} is claimed by a second agent (instance "
            f"{c.refused}, heard {c.age_s:.1f}s ago); instance {c.holder} keeps it"
        )
    return "\n".join(printable(line) for line in lines)


def heartbeat_view_text(view: HeartbeatView) -> str:
    """The fleet as its heartbeats say, under a first line that says no coordinator
    answered, so nobody takes it for the coordinator's status."""
    lines = [
        f"NO COORDINATOR ANSWERED on fleet {view.fleet}: this view comes from the agents' "
        "heartbeats only (no committed version, no rank offsets, no update in flight)",
        f"heard {len(view.members)} member(s) on {view.subject} in {view.listened_s:.1f}s; "
        f"live world size {view.live_world_size}"
        + (f"; {view.ignored} heartbeat(s) ignored (malformed or forged)" if view.ignored else ""),
    ]
    lines.extend(_member_table(view.members))
    # No coordinator, so no update is in flight: any paused engine is paused outside one.
    lines.extend(member_warnings(view.members, update_in_flight=False))
    return "\n".join(printable(line) for line in lines)


def _missing_text(missing: Sequence[str]) -> str:
    if not missing:
        return "its agent has not brought the engine to the committed state"
    shown = ", ".join(printable(name) for name in missing[:4])
    more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
    return f"its engine lacks {shown}{more}: its agent is loading them"


def member_warnings(members: Sequence[MemberStatus], *, update_in_flight: bool) -> list[str]:
    """One ``WARNING`` line per member that needs a look: an engine paused while no
    update is in flight (nobody will resume it but its agent's pause lease), an
    engine not ready (its agent has not brought it to the committed state), and
    an agent that ignores a fleet state record it cannot trust (garbage, or not
    sealed by the fleet's key)."""
    lines = []
    for m in members:
        if m.paused and not update_in_flight:
            lines.append(
                f"WARNING: {m.worker_id} is paused outside any update (its agent resumes it "
                "when its pause lease ends; until then it serves nothing)"
            )
        if not m.ready:
            why = m.unready_reason or _missing_text(m.missing)
            lines.append(f"WARNING: {m.worker_id} is not ready ({why})")
        if m.unreadable_state:
            lines.append(
                f"WARNING: {m.worker_id} ignores fleet state it cannot trust: {m.unreadable_state}"
            )
    return lines


def _member_table(members: Sequence[MemberStatus]) -> list[str]:
    lines = [
        f"{'worker':<12} {'world':>5} {'offset':>6} {'engine':<8} {'paused':<6} "
        f"{'ready':<5} {'beat':>6}  adapters"
    ]
    for m in members:
        offset = "-" if m.rank_offset is None else str(m.rank_offset)
        # A bounded engine shows how full it is: "3/4: a-v1, ...".
        full = f"{len(m.adapters)}/{m.capacity}: " if m.capacity is not None else ""
        labels = "".join(f" [{k}={v}]" for k, v in sorted(m.labels.items()))
        if m.role != WorkerRole.AGGREGATED:
            labels += f" ({m.role})"
        if m.data_parallel > 1:
            labels += f" ({m.data_parallel} data-parallel ranks)"
        lines.append(
            f"{m.worker_id:<12} {m.world_size:>5} {offset:>6} {m.engine:<8} "
            f"{'yes' if m.paused else 'no':<6} {'yes' if m.ready else 'no':<5} "
            f"{m.heartbeat_age_s:>5.1f}s  "
            f"{full}{', '.join(m.adapters) or '-'}{labels}"
        )
    return lines
