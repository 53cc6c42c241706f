"""Child processes of a chaos run: started, signalled, and always reaped.

Kills must be real, so agents and coordinators run as ``lorabus`` OS
processes, started and reaped by :mod:`lorabus.testbed.child_processes`: every child
started here is stopped by :meth:`ProcessGroup.aclose` (also on Ctrl-C,
through the runner's ``async with``), a suspended one continued first, so
none outlives the run. Each child also carries what the fleet needs to tell a
fault from a crash: when it started, and whether it ended on purpose.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lorabus.testbed.child_processes import LORABUS, ChildGroup, ChildProcess


@dataclass(eq=False)
class Child(ChildProcess):
    started_at: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when it was started."""


class ProcessGroup(ChildGroup[Child]):
    """Starts ``lorabus`` children with their stderr in ``log_dir``; reaps them all."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__()
        self.log_dir = log_dir
        self._counts: dict[str, int] = {}

    async def start(self, name: str, args: Sequence[str], *, log_level: str = "INFO") -> Child:
        """Start ``lorabus --log-level L <args>``; its stderr goes to ``<log_dir>/<name>.N.log``."""
        count = self._counts[name] = self._counts.get(name, 0) + 1
        argv = [LORABUS, "--log-level", log_level, *args]
        return self.adopt(await Child.spawn(name, argv, self.log_dir / f"{name}.{count}.log"))
