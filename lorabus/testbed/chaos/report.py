"""The figures of a chaos run: counts, latencies, what was injected and found.

Built from the timeline after the run; printed as a few lines of figures
(:meth:`ChaosReport.figure_lines`; with several tenants, a line per tenant)
and the summary line the CLI ends with, and written as JSON with ``--out``.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

import msgspec

from lorabus.testbed.chaos.invariants import Violation, count_by_adapter, count_by_invariant
from lorabus.testbed.chaos.restarts import restart_coverage
from lorabus.testbed.chaos.schedule import Fault
from lorabus.testbed.chaos.timeline import Timeline, UpdateRecord


class ChaosReport(msgspec.Struct, kw_only=True):
    seed: int
    duration_s: float
    elapsed_s: float
    world_sizes: dict[str, int]
    settings: dict[str, Any]
    attempted: int
    committed: int
    failed_cleanly: int
    failed_by_code: dict[str, int]
    no_terminal_result: int
    retried: int
    """Updates that needed more than one attempt (same update id)."""
    goodput: float
    """The share of updates asked for that committed, the requester asking
    again with the same id until its retry bound, as an orchestrator does."""
    commit_latency_s: dict[str, float]
    faults_injected: int
    faults_by_kind: dict[str, int]
    faults_skipped: list[str]
    one_call_requests: dict[str, Any]
    """The frozen-leader requests, each one client call: how many, how they
    ended, how long the call took, against what timeout."""
    schedule: list[str]
    violations_by_invariant: dict[str, int]
    violations: list[Violation]
    observed: dict[str, Any]
    run_dir: str
    adapter_store: dict[str, Any] = {}
    """By bus: the pushes by kind, the store's samples, and the requests
    refused because their adapter was not (or no longer) in the store."""
    tenants: dict[str, dict[str, Any]] = {}
    """Per tenant's adapter: its updates asked for (``attempted``),
    ``committed``, ``failed_by_code``, ``no_terminal_result``, ``goodput``."""
    violations_by_adapter: dict[str, int] = {}
    """Violations per adapter they name (one naming several counts for each)."""

    @property
    def ok(self) -> bool:
        return not self.violations

    def figure_lines(self) -> list[str]:
        """Faults by kind, updates by outcome, and the one-call requests."""
        kinds = ", ".join(f"{kind} {n}" for kind, n in self.faults_by_kind.items()) or "none"
        codes = ", ".join(f"{code} {n}" for code, n in self.failed_by_code.items())
        lines = [
            f"faults: {self.faults_injected} injected ({kinds}); "
            f"{len(self.faults_skipped)} skipped",
            f"updates: attempted {self.attempted}, committed {self.committed}, "
            f"failed {self.attempted - self.committed - self.no_terminal_result}"
            + (f" ({codes})" if codes else "")
            + f", without a terminal result {self.no_terminal_result}; "
            f"{self.retried} needed the same id asked again; goodput {self.goodput:.0%}",
        ]
        if len(self.tenants) > 1:
            lines += [_tenant_line(adapter, t) for adapter, t in self.tenants.items()]
        store = self.adapter_store
        if store.get("pushes"):
            kinds = store["pushes"]
            lines.append(
                f"adapter store: pushed {sum(kinds.values())} (new {kinds.get('new', 0)}, "
                f"earlier bytes again {kinds.get('again', 0)} ({store['uploaded_again']} "
                f"uploaded again after their deletion), orphans {kinds.get('orphan', 0)}); "
                f"{store['samples']} samples, {store['samples_skipped']} skipped, at most "
                f"{store['most_objects']} objects; {store['refused_not_stored']} requests "
                "refused as not in the store"
            )
        calls = self.one_call_requests
        if calls.get("made"):
            outcomes = ", ".join(f"{what} {n}" for what, n in calls["outcomes"].items())
            took = calls["call_s"]
            lines.append(
                f"frozen-leader requests (one client call each): {calls['made']} ({outcomes}); "
                f"call p50 {took.get('p50', 0):.1f}s, max {took.get('max', 0):.1f}s, "
                f"timeout {calls['timeout_s']:.0f}s"
            )
        return lines

    def summary_line(self) -> str:
        return (
            f"chaos: updates attempted {self.attempted} / committed {self.committed} / "
            f"failed cleanly {self.failed_cleanly} (goodput {self.goodput:.0%}), "
            f"faults injected {self.faults_injected}, "
            f"invariant violations {len(self.violations)}"
        )


def _tenant_line(adapter: str, tenant: dict[str, Any]) -> str:
    codes = ", ".join(f"{code} {n}" for code, n in tenant["failed_by_code"].items())
    failed = sum(tenant["failed_by_code"].values())
    return (
        f"tenant {adapter}: asked {tenant['attempted']}, committed {tenant['committed']}, "
        f"failed {failed}" + (f" ({codes})" if codes else "") + ", without a terminal result "
        f"{tenant['no_terminal_result']}; goodput {tenant['goodput']:.0%}"
    )


def _tenants(updates: list[UpdateRecord]) -> dict[str, dict[str, Any]]:
    by_adapter: dict[str, list[UpdateRecord]] = {}
    for update in updates:
        by_adapter.setdefault(update.adapter, []).append(update)
    figures = {}
    for adapter, asked in sorted(by_adapter.items()):
        results = [u.result for u in asked]
        committed = sum(r is not None and r.committed for r in results)
        codes = Counter(
            str(r.error.code) if r.error else "unknown"
            for r in results
            if r is not None and not r.committed
        )
        figures[adapter] = {
            "attempted": len(asked),
            "committed": committed,
            "failed_by_code": dict(sorted(codes.items())),
            "no_terminal_result": sum(r is None for r in results),
            "goodput": round(committed / len(asked), 4),
        }
    return figures


def build_report(
    *,
    seed: int,
    duration_s: float,
    elapsed_s: float,
    settings: dict[str, Any],
    timeline: Timeline,
    schedule: list[Fault],
    injected: list[Fault],
    skipped: list[tuple[Fault, str]],
    violations: list[Violation],
    run_dir: str,
) -> ChaosReport:
    results = [u.result for u in timeline.updates]
    committed = [r for r in results if r is not None and r.committed]
    failed = [r for r in results if r is not None and not r.committed]
    codes = Counter(str(r.error.code) if r.error else "unknown" for r in failed)
    latencies = [sum(r.phases.values()) for r in committed]
    return ChaosReport(
        seed=seed,
        duration_s=duration_s,
        elapsed_s=round(elapsed_s, 1),
        world_sizes=dict(timeline.world_sizes),
        settings=settings,
        attempted=len(timeline.updates),
        committed=len(committed),
        failed_cleanly=len(failed) - codes.get("internal", 0),
        failed_by_code=dict(sorted(codes.items())),
        no_terminal_result=sum(r is None for r in results),
        retried=sum(len(u.attempts) > 1 for u in timeline.updates),
        goodput=round(len(committed) / len(results), 4) if results else 1.0,
        commit_latency_s=_spread(latencies),
        faults_injected=len(injected),
        faults_by_kind=dict(sorted(Counter(str(f.kind) for f in injected).items())),
        faults_skipped=[f"{f.describe()}: {why}" for f, why in skipped],
        one_call_requests=_one_calls(timeline),
        schedule=[f.describe() for f in schedule],
        violations_by_invariant=count_by_invariant(violations),
        violations=violations,
        observed=_observed(timeline),
        run_dir=run_dir,
        adapter_store=_adapter_store(timeline),
        tenants=_tenants(timeline.updates),
        violations_by_adapter=count_by_adapter(violations),
    )


_NOT_STORED = ("not in the fleet's object store", "being deleted from the fleet's object store")


def _adapter_store(timeline: Timeline) -> dict[str, Any]:
    if not timeline.pushes:
        return {}
    refused = [
        u.update_id
        for u in timeline.updates
        if u.result is not None
        and u.result.error is not None
        and any(said in u.result.error.message for said in _NOT_STORED)
    ]
    return {
        "pushes": dict(sorted(Counter(p.kind for p in timeline.pushes).items())),
        "uploaded_again": sum(p.kind == "again" and p.uploaded for p in timeline.pushes),
        "samples": len(timeline.store_samples),
        "samples_skipped": timeline.store_samples_skipped,
        "most_objects": max((len(s.stored) for s in timeline.store_samples), default=0),
        "refused_not_stored": len(refused),
        "refused_not_stored_ids": refused,
    }


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 4),
        "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 4),
        "max": round(ordered[-1], 4),
    }


def _one_calls(timeline: Timeline) -> dict[str, Any]:
    calls = [u for u in timeline.updates if u.one_call]
    if not calls:
        return {"made": 0}
    outcomes = Counter(
        f"unanswered ({u.attempts[-1][:40]})"
        if u.result is None
        else str(u.result.error.code)
        if u.result.error
        else u.result.status
        for u in calls
        if u.attempts
    )
    return {
        "made": len(calls),
        "outcomes": dict(sorted(outcomes.items())),
        "call_s": _spread([u.call_s for u in calls if u.call_s is not None]),
        "timeout_s": max(u.one_call_timeout_s or 0.0 for u in calls),
    }


def _observed(timeline: Timeline) -> dict[str, Any]:
    longest = {
        worker_id: round(
            max(((s.end or timeline.ended_at or s.start) - s.start for s in spans), default=0.0),
            3,
        )
        for worker_id, spans in sorted(timeline.pauses.items())
    }
    return {
        "events": dict(sorted(timeline.event_counts.items())),
        "leader_epochs": [epoch for _, _, epoch in timeline.leaders],
        "commands_refused": len(timeline.refused),
        "commands_handled": len(timeline.handled),
        "pauses": sum(len(spans) for spans in timeline.pauses.values()),
        "longest_pause_s": longest,
        "undecodable_messages": timeline.undecodable,
        "ready_after_restart": restart_coverage(timeline),
        "crashes": list(timeline.crashes),
    }


def report_json(report: ChaosReport) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report), indent=2)
