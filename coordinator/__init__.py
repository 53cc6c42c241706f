"""lorabus coordinator: runs updates across a fleet's agents over the bus.

Never imports ``agents``: the two meet only on the bus.
"""

from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.service import Coordinator

__all__ = ["Coordinator", "CoordinatorConfig"]
