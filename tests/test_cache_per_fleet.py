"""An agent keeps adapters in a cache of its fleet by default
(``$XDG_CACHE_HOME/lorabus/adapters/<fleet>``), says what its engine holds in
a holder file named after its fleet and worker (so agents of two fleets
sharing a ``--cache-dir`` never write each other's), and counts its cache's
housekeeping in its metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from memory_fleet import MemoryEngine

from lorabus.agents import Agent, AgentConfig
from lorabus.agents.metrics import AgentMetrics, instrumented


def built(fleet: str, metrics: AgentMetrics, **settings: str) -> Agent:
    config = AgentConfig(fleet=fleet, worker_id="w0", system_url="http://127.0.0.1:9", **settings)
    return Agent.from_config(config, instrumented(MemoryEngine(), metrics, config.worker_id))


def test_each_fleet_has_a_cache_of_its_own_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for fleet in ("fleet-a", "fleet-b"):
        cache = built(fleet, AgentMetrics()).executor.store_loads.adapter_cache
        assert cache is not None
        assert cache.directory == str(tmp_path / "lorabus" / "adapters" / fleet)


def test_agents_of_two_fleets_sharing_a_cache_hold_in_files_of_their_own(tmp_path: Path) -> None:
    metrics = AgentMetrics()
    shared = str(tmp_path / "cache")
    keepers = [
        built(f, metrics, cache_dir=shared).executor.store_loads.cache_keeper for f in ("a", "b")
    ]
    for keeper, digest in zip(keepers, ("sha256:" + "1" * 64, "sha256:" + "2" * 64), strict=True):
        assert keeper is not None
        keeper.hold({"policy-v1": [digest]})

    assert sorted(p.name for p in (tmp_path / "cache" / ".holders").iterdir()) == [
        "a.w0.json",
        "b.w0.json",
    ]


def test_a_failed_holder_write_is_counted_in_the_agents_metrics(tmp_path: Path) -> None:
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / ".holders").write_text("not a folder")
    metrics = AgentMetrics()
    agent = built("a", metrics, cache_dir=str(tmp_path / "cache"))
    keeper = agent.executor.store_loads.cache_keeper
    assert keeper is not None

    keeper.hold({"policy-v1": ["sha256:" + "1" * 64]})

    errors = "lorabus_adapter_cache_errors_total"
    assert metrics.registry.get_sample_value(errors, {"operation": "hold"}) == 1.0
    assert metrics.registry.get_sample_value(errors, {"operation": "prune"}) == 0.0
    assert metrics.registry.get_sample_value("lorabus_adapter_cache_removed_total") == 0.0
