"""``lorabus bench``: lorabus against the direct-HTTP way and the bare bus.

For fleets of N simulated workers it measures, on one machine and one
simulated fleet: lorabus updates through real NATS with null engines and with
the Dynamo driver over HTTP; the same update done the direct-HTTP way (prime-rl's)
way, one HTTP client per worker from one process; and the bus floor, a bare
nats-py fan-out and gather. Every measured part runs in a process of its own.
The distribution series (``--series distribution``) gets an adapter of S MB to
N agents over the bus, beside path mode and an HTTP pull of the same files; the
tenants series (``--series tenants``) has T tenants update adapters of their
own at once, in live and in pause mode; the placement series (``--series
placement``) places T tenants' adapters on engines that cannot hold them all.

Modules: ``config`` (what to run), ``procinfo`` (CPU and memory from /proc),
``children`` and ``control`` (bench processes and their JSON-line protocol),
``engines`` (null engine, timing wrapper), ``fleet`` (one size's nats-server,
simulated fleet and agent hosts), ``agenthost`` (many agents in one
process), ``simhost`` (the simulated fleet), ``baseline`` (direct HTTP),
``floor`` (the bare bus), ``frontend`` (a model list for null engines),
``runner`` (the run: ``lorabus.testbed.bench.runner.run_bench``),
``distribution`` and ``httppull`` (the distribution series and its HTTP-pull
reference), ``tenants`` (the tenants series), ``placement`` (the placement
series), ``figures``, ``report``, ``distreport``, ``tenantsreport`` and
``placementreport`` (figures, tables, targets).

Only the modules that need no ``sim`` extra are imported here, so that the
CLI can read ``BenchConfig``'s defaults without it.
"""

from lorabus.testbed.bench.config import (
    FULL,
    QUICK,
    BenchConfig,
    DistributionCase,
    PlacementCase,
    TenantsCase,
    WindowCase,
)
from lorabus.testbed.bench.distreport import DistributionResult
from lorabus.testbed.bench.report import BenchReport, ModeResult, Stats, report_json, table
from lorabus.testbed.bench.tenantsreport import TenantResult

__all__ = [
    "FULL",
    "QUICK",
    "BenchConfig",
    "BenchReport",
    "DistributionCase",
    "DistributionResult",
    "ModeResult",
    "PlacementCase",
    "Stats",
    "TenantResult",
    "TenantsCase",
    "WindowCase",
    "report_json",
    "table",
]
