"""lorabus agents: one per inference worker, driving its engine on the bus's orders.

Never imports ``coordinator``: the two meet only on the bus.
"""

from agents.agent import Agent
from agents.dynamo import DynamoDriver
from agents.engine import EngineDriver
from agents.executor import CommandExecutor

__all__ = ["Agent", "CommandExecutor", "DynamoDriver", "EngineDriver"]
