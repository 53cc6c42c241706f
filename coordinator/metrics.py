"""Prometheus metrics of the coordinator, in a registry of its own.

Recorded always (a counter increment costs less than the check whether
anyone listens); served over HTTP by the CLI only with ``--metrics-port``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from lorabus.coordinator.alerts import MemberAlerts
from lorabus.coordinator.membership import Membership

ADAPTER_LABELS = 64
"""Adapters with series of their own: the first this process counts; later
ones share the label ``other``. Adapter names come from requests, so an
orchestrator naming thousands of adapters must not make thousands of series."""
OTHER_ADAPTERS = "other"

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class CoordinatorMetrics:
    def __init__(self, membership: Membership, alerts: MemberAlerts) -> None:
        self.registry = CollectorRegistry()
        self.update_seconds = Histogram(
            "lorabus_update_duration_seconds",
            "Whole update, request taken to result, by adapter (the first "
            f"{ADAPTER_LABELS} adapters; later ones as {OTHER_ADAPTERS!r}).",
            ["adapter"],
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.phase_seconds = Histogram(
            "lorabus_phase_duration_seconds",
            "One phase of an update.",
            ["phase"],
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.pause_window_seconds = Histogram(
            "lorabus_pause_window_seconds",
            "From the first pause sent to the last resume ack.",
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.updates = Counter(
            "lorabus_updates",
            "Updates by outcome (committed, failed) and adapter (the first "
            f"{ADAPTER_LABELS} adapters; later ones as {OTHER_ADAPTERS!r}).",
            ["outcome", "adapter"],
            registry=self.registry,
        )
        self.updates_running = Gauge(
            "lorabus_updates_running",
            "Updates running now (those of different adapters run at once).",
            registry=self.registry,
        )
        self._adapter_labels: set[str] = set()
        self.acks = Counter(
            "lorabus_acks",
            "Acks by phase and outcome (ok, failed, missing).",
            ["phase", "outcome"],
            registry=self.registry,
        )
        self.replies_refused = Counter(
            "lorabus_replies_refused",
            "Requests refused and not acted on because their reply subject is no "
            "inbox, by request (update, status, result, reset).",
            ["request"],
            registry=self.registry,
        )
        # One series each, whatever the number of terms: an epoch as a label
        # would start a new series at every failover.
        self.leading = Gauge(
            "lorabus_coordinator_leading",
            "1 while this coordinator leads, else 0.",
            registry=self.registry,
        )
        self.epoch = Gauge(
            "lorabus_coordinator_epoch",
            "The epoch of this coordinator's latest term as leader (0: never led).",
            registry=self.registry,
        )
        self.bus_connected = Gauge(
            "lorabus_bus_connected",
            "1 while this process is connected to NATS, else 0 (waiting for it, reconnecting).",
            registry=self.registry,
        )
        self.registry.register(_MembershipCollector(membership, alerts))

    def adapter_label(self, adapter: str) -> str:
        """``adapter`` as a label value: its own for the first
        :data:`ADAPTER_LABELS` adapters, :data:`OTHER_ADAPTERS` after."""
        if adapter in self._adapter_labels:
            return adapter
        if len(self._adapter_labels) < ADAPTER_LABELS:
            self._adapter_labels.add(adapter)
            return adapter
        return OTHER_ADAPTERS


class _MembershipCollector(Collector):
    """Read at scrape time, so ages are current without a ticking task."""

    def __init__(self, membership: Membership, alerts: MemberAlerts) -> None:
        self.membership = membership
        self.alerts = alerts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        live = self.membership.live()
        paused = GaugeMetricFamily(
            "lorabus_engines_paused", "Live engines whose last heartbeat or ack said paused."
        )
        paused.add_metric([], sum(m.heartbeat.paused for m in live.values()))
        yield paused
        age = GaugeMetricFamily(
            "lorabus_heartbeat_age_seconds",
            "Seconds since each live worker's last heartbeat.",
            labels=["worker"],
        )
        for worker_id, member in sorted(live.items()):
            age.add_metric([worker_id], self.membership.age_of(member))
        yield age
        alerts = GaugeMetricFamily(
            "lorabus_member_alerts",
            "Members the leader has raised a member_alert for, by condition "
            "(paused_outside_update, not_ready); 0 on a coordinator not leading.",
            labels=["condition"],
        )
        for condition, count in self.alerts.counts().items():
            alerts.add_metric([str(condition)], count)
        yield alerts
