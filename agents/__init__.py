"""lorabus agents: one per inference worker, driving its engine on the bus's orders.

Never imports ``coordinator``: the two meet only on the bus.
"""

from lorabus.agents.agent import Agent
from lorabus.agents.config import AgentConfig
from lorabus.agents.dynamo import DynamoDriver
from lorabus.agents.engine import EngineDriver
from lorabus.agents.engines import ENGINE_KINDS, driver_for
from lorabus.agents.executor import CommandExecutor
from lorabus.agents.sglang import SglangDriver
from lorabus.agents.vllm import VllmDriver

__all__ = [
    "ENGINE_KINDS",
    "Agent",
    "AgentConfig",
    "CommandExecutor",
    "DynamoDriver",
    "EngineDriver",
    "SglangDriver",
    "VllmDriver",
    "driver_for",
]
