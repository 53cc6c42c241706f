"""Which engine driver an agent uses, by the kind its config names.

The one place that maps ``--engine`` to an implementation of
:class:`~lorabus.agents.engine.EngineDriver`.
"""

from __future__ import annotations

from lorabus.agents.config import AgentConfig
from lorabus.agents.dynamo import DynamoDriver
from lorabus.agents.engine import EngineDriver

ENGINE_KINDS = ("dynamo",)


def driver_for(config: AgentConfig) -> EngineDriver:
    """A driver for the engine ``config`` names, with its URL, headers and timeout."""
    if config.engine == "dynamo":
        return DynamoDriver(
            config.system_url, headers=config.headers, timeout_s=config.engine_timeout_s
        )
    raise ValueError(f"unknown engine {config.engine!r}: use one of {', '.join(ENGINE_KINDS)}")
