"""Which engine driver an agent uses, by the kind its config names.

The one place that maps ``--engine`` to an implementation of
:class:`~lorabus.agents.engine.EngineDriver`.
"""

from __future__ import annotations

from lorabus.agents.config import ENGINE_KINDS, AgentConfig
from lorabus.agents.dynamo import DynamoDriver
from lorabus.agents.engine import EngineDriver
from lorabus.agents.sglang import SglangDriver
from lorabus.agents.vllm import VllmDriver

__all__ = ["ENGINE_KINDS", "driver_for"]

_DRIVERS: dict[str, type[DynamoDriver] | type[VllmDriver] | type[SglangDriver]] = {
    "dynamo": DynamoDriver,
    "vllm": VllmDriver,
    "sglang": SglangDriver,
}


def driver_for(config: AgentConfig) -> EngineDriver:
    """A driver for the engine ``config`` names, with its URL, headers and timeout."""
    driver = _DRIVERS.get(config.engine)
    if driver is None:
        raise ValueError(f"unknown engine {config.engine!r}: use one of {', '.join(ENGINE_KINDS)}")
    if driver is DynamoDriver:
        return DynamoDriver(
            config.system_url,
            headers=config.headers,
            timeout_s=config.engine_timeout_s,
            frontend_url=config.frontend_url,
            discovery_url=config.frontend_discovery_url,
            role=config.role,
        )
    return driver(
        config.system_url,
        headers=config.headers,
        admin_headers=config.admin_headers,
        timeout_s=config.engine_timeout_s,
    )
