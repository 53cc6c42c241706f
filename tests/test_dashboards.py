"""What ships for Prometheus and Grafana names only what lorabus serves: every
series in the rules (deploy/prometheus/lorabus-rules.yml) and the dashboard
(deploy/grafana/lorabus-dashboard.json) is one of the coordinator's or an
agent's metrics, and Prometheus scrapes every coordinator and agent of
compose.yaml where it serves them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from lorabus.agents.metrics import AgentMetrics
from lorabus.coordinator.alerts import MemberAlerts
from lorabus.coordinator.membership import Membership
from lorabus.coordinator.metrics import CoordinatorMetrics

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "lorabus-rules.yml"
SCRAPES = REPO / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "lorabus-dashboard.json"
_SERIES = re.compile(r"\blorabus_[a-z0-9_]+")
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}


def _served() -> set[str]:
    """Every series name lorabus's coordinator and agents can serve."""
    families = [
        *CoordinatorMetrics(Membership(), MemberAlerts()).registry.collect(),
        *AgentMetrics().registry.collect(),
    ]
    return {f.name + suffix for f in families for suffix in _SUFFIXES.get(f.type, ("",))}


def _rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def _dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def test_every_series_the_rules_and_the_dashboard_name_is_served() -> None:
    served = _served()
    for where, exprs in (("rules", _rule_exprs()), ("dashboard", _dashboard_exprs())):
        named = {name for expr in exprs for name in _SERIES.findall(expr)}
        assert named, f"the {where} name no series at all"
        assert named <= served, f"the {where} name series lorabus does not serve: {named - served}"


def test_the_rules_cover_what_an_operator_must_hear_of() -> None:
    alerts = {
        rule["alert"]: rule["expr"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }
    wanted = {
        "updates failing": "lorabus_updates_total",
        "engines paused without an update": "paused_outside_update",
        "engines paused long": "lorabus_engines_paused",
        "members not ready": "not_ready",
        "the leader changing often": "changes(lorabus_coordinator_epoch",
    }
    for what, mark in wanted.items():
        assert any(mark in expr for expr in alerts.values()), f"no alert for {what}"


def test_prometheus_scrapes_every_coordinator_and_agent_where_it_serves_metrics() -> None:
    services = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    scrapes = yaml.safe_load(SCRAPES.read_text())["scrape_configs"]
    targets = {t for job in scrapes for config in job["static_configs"] for t in config["targets"]}
    lorabus = [
        name
        for name, service in services.items()
        if isinstance(service.get("command"), list)
        and service["command"][:2] in (["lorabus", "coordinator"], ["lorabus", "agent"])
    ]
    assert lorabus, "compose.yaml has coordinators and agents"
    for name in lorabus:
        command = services[name]["command"]
        assert "--metrics-port=9100" in command, f"{name} serves no metrics on 9100"
        assert f"{name}:9100" in targets, f"prometheus does not scrape {name}"
    assert targets <= {f"{name}:9100" for name in lorabus}, "a target that is no service"
