"""The chaos suite: updates in a loop while real faults hit a real fleet.

Modules, one job each: ``config`` (the run's settings), ``schedule`` (the
seeded, reproducible fault schedule), ``procs`` (child processes, always
reaped), ``fleet`` (NATS, the simulated engines, agent and coordinator
processes, and the faults on them), ``inject`` (applying and healing the
schedule), ``observe`` (watching the engines and the bus), ``store_watch``
(sampling the adapter object store against its records), ``timeline`` (what
was seen, on one clock), ``adapters`` (each step's adapter: written, and
pushed to the store), ``updates`` (one trainer's update loop with same-id
retries), ``tenants`` (the trainers, one loop per adapter) and ``quiet``
(the quiet windows they share), ``invariants`` (the registry of the checks,
which live in ``pauses``, ``serving``, ``restarts``, ``results``,
``processes`` and ``store_keeps``, on ``verdict``'s types and ``commits``'s
view of what was committed), ``report`` (the figures) and ``runner`` (the
whole run: ``lorabus.testbed.chaos.runner.run_chaos``).

Only the modules that need no ``sim`` extra are imported here, so that the
CLI can read ``ChaosConfig``'s defaults without it.
"""

from lorabus.testbed.chaos.config import ChaosConfig, FleetSettings
from lorabus.testbed.chaos.invariants import INVARIANTS, Bounds, Violation, check_all
from lorabus.testbed.chaos.report import ChaosReport, report_json
from lorabus.testbed.chaos.schedule import ALL_KINDS, Fault, FaultKind, build_schedule
from lorabus.testbed.chaos.timeline import Timeline

__all__ = [
    "ALL_KINDS",
    "INVARIANTS",
    "Bounds",
    "ChaosConfig",
    "ChaosReport",
    "Fault",
    "FaultKind",
    "FleetSettings",
    "Timeline",
    "Violation",
    "build_schedule",
    "check_all",
    "report_json",
]
