"""What a benchmark run measures, validated in one place, and its two profiles.

Importable without the ``sim`` extra, so that the CLI shows these defaults in
``lorabus bench --help`` whether or not the extra is installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SERIES = ("updates", "distribution", "tenants", "placement")
MODES = ("floor", "null", "http", "live", "baseline")
CONNECTIONS = ("own", "shared", "node")
NODE_WORKERS = 8
"""Workers per node in the ``node`` layout: one node agent (agents/node.py)
and one connection per 8 workers, as an 8-GPU node at tensor parallel 1."""
FULL_SIZES = (8, 64, 256, 1024)
QUICK_SIZES = (8, 64, 256)


@dataclass(frozen=True)
class WindowCase:
    """A fleet size with realistic load latency, to see the pause window."""

    n: int = 256
    load_latency_s: float = 0.2
    load_jitter_s: float = 0.05


@dataclass(frozen=True)
class DistributionCase:
    """The distribution series: an adapter of S MB to fleets of N agents,
    ``agents_per_node`` of them sharing each node's cache directory."""

    sizes: tuple[int, ...] = (8, 64)
    adapter_mb: tuple[int, ...] = (16, 128)
    agents_per_node: int = 8
    updates: int = 3
    """Timed updates per point (N, S) and way (bus, path, HTTP pull)."""
    warmup: int = 1

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError("distribution sizes must be positive")
        if not self.adapter_mb or min(self.adapter_mb) < 1:
            raise ValueError("adapter sizes must be at least 1 MB")
        if self.agents_per_node < 1:
            raise ValueError("agents per node must be >= 1")
        if self.updates < 1 or self.warmup < 0:
            raise ValueError("distribution updates must be >= 1 and warm-ups >= 0")

    def nodes_for(self, n: int) -> int:
        return -(-n // self.agents_per_node)


TENANT_MODES = ("live", "pause")
TENANT_LAYOUTS = ("own", "node")


@dataclass(frozen=True)
class TenantsCase:
    """The tenants series: T trainers, each updating an adapter of its own in a
    loop, against one fleet of N workers with null engines, live and paused."""

    tenants: tuple[int, ...] = (1, 8, 32)
    sizes: tuple[int, ...] = (64, 256)
    modes: tuple[str, ...] = TENANT_MODES
    seconds: float = 20.0
    """The timed window of each case (N, mode, T)."""
    warmup: int = 2
    """Untimed updates of each tenant first, all tenants at once."""
    layout: str = "own"
    """The agents' NATS connections: ``own`` (one per agent) or ``node``
    (agents of 8 workers, one connection each)."""

    def __post_init__(self) -> None:
        if self.layout not in TENANT_LAYOUTS:
            raise ValueError(f"tenant connections must be one of {', '.join(TENANT_LAYOUTS)}")
        if not self.tenants or min(self.tenants) < 1:
            raise ValueError("tenants must be positive")
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError("tenant fleet sizes must be positive")
        if not self.modes or set(self.modes) - set(TENANT_MODES):
            raise ValueError(f"tenant modes must be among {', '.join(TENANT_MODES)}")
        if self.seconds <= 0 or self.warmup < 0:
            raise ValueError("tenant seconds must be > 0 and warm-ups >= 0")


@dataclass(frozen=True)
class PlacementCase:
    """The placement series: T tenants' adapters, ``keep`` versions each, on N
    workers whose engines hold ``capacity`` adapters, fewer than T x keep:
    each adapter is placed on as many workers as the capacity allows."""

    tenants: int = 32
    sizes: tuple[int, ...] = (64,)
    capacity: int = 6
    keep: int = 2
    rounds: int = 3
    """Updates of every tenant before one worker is stopped, and again after."""

    def __post_init__(self) -> None:
        if self.tenants < 1 or not self.sizes or min(self.sizes) < 2:
            raise ValueError("placement needs tenants >= 1 and fleets of 2 workers or more")
        if self.keep < 1 or self.rounds < 1:
            raise ValueError("placement keep and rounds must be >= 1")
        if self.capacity < self.keep + 1:
            raise ValueError(
                f"capacity {self.capacity} cannot hold an adapter's {self.keep} kept "
                "versions and its next one"
            )

    def replicas_for(self, n: int) -> int:
        """The most workers per adapter whose load fits every engine once one
        of the N is stopped: a worker holds T x R / (N - 1) adapters or one
        more, each with ``keep`` versions, and its next one while it updates."""
        per_worker = self.capacity // (self.keep + 1)
        return max(1, min(n - 1, per_worker * (n - 1) // self.tenants))


@dataclass(frozen=True)
class BenchConfig:
    sizes: tuple[int, ...] = FULL_SIZES
    updates: int = 20
    """Timed updates per size and mode."""
    warmup: int = 2
    """Untimed updates first (connections, caches, KV records)."""
    world_sizes: tuple[int, ...] = (2, 4, 1, 1)
    """Cycled over the workers."""
    load_latency_s: float = 0.0
    load_jitter_s: float = 0.0
    window_case: WindowCase | None = WindowCase()
    window_updates: int | None = None
    """Timed updates of the window case; default half of ``updates`` (at least 5)."""
    modes: tuple[str, ...] = MODES
    connections: tuple[str, ...] = CONNECTIONS
    """Layouts of the agents' NATS connections for the floor and null modes."""
    http_connections: tuple[str, ...] = ("own",)
    agent_procs: int = 4
    """Agent host processes the fleet's agents are spread over."""
    sim_workers: int = 1024
    """Simulated workers per process of the simulated fleet: one process
    accepting thousands of engine connections at once falls behind (at
    N = 4096 the agents' connects timed out), where a fleet's engines each
    accept their own."""
    heartbeat_s: float | None = None
    """Agents' heartbeat interval; default max(1, N/128) (docs/performance.md)."""
    keep: int | None = None
    """The coordinator's ``--keep``; default every version of the run, so that
    lorabus does the same engine work as the baseline, which unloads nothing."""
    canary: bool = True
    """Whether the coordinators run the canary phase (off: to measure its cost)."""
    idle_s: float = 2.0
    """How long the coordinator's idle CPU is watched before the updates."""
    run_dir: Path | None = None
    """Logs of every process; default a temporary directory, kept on failure."""
    secure: bool = False
    """Each mode's NATS runs with ``lorabus auth init``'s configuration (nkeys,
    per-role permissions, mutual TLS) and every process as its own identity."""
    label: str = "full"
    series: tuple[str, ...] = ("updates",)
    """``updates`` (the modes above, size by size), ``distribution`` and ``tenants``."""
    distribution: DistributionCase = DistributionCase()
    tenants: TenantsCase = TenantsCase()
    placement: PlacementCase = PlacementCase()

    def __post_init__(self) -> None:
        if not self.series or set(self.series) - set(SERIES):
            raise ValueError(f"series must be among {', '.join(SERIES)}")
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError("sizes must be positive")
        if self.updates < 1 or self.warmup < 0:
            raise ValueError("updates must be >= 1 and warmup >= 0")
        if not self.world_sizes or min(self.world_sizes) < 1:
            raise ValueError("world sizes must be positive")
        if self.load_latency_s < 0 or self.load_jitter_s < 0:
            raise ValueError("load latency and jitter must be >= 0")
        if self.load_jitter_s > self.load_latency_s:
            raise ValueError("load jitter must not exceed the load latency")
        unknown = set(self.modes) - set(MODES)
        if unknown or not self.modes:
            raise ValueError(f"modes must be among {', '.join(MODES)}")
        for layouts in (self.connections, self.http_connections):
            if not layouts or set(layouts) - set(CONNECTIONS):
                raise ValueError(f"connections must be among {', '.join(CONNECTIONS)}")
        if self.window_updates is not None and self.window_updates < 1:
            raise ValueError("window updates must be >= 1")
        if self.agent_procs < 1:
            raise ValueError("agent processes must be >= 1")
        if self.sim_workers < 1:
            raise ValueError("simulated workers per process must be >= 1")
        if self.heartbeat_s is not None and self.heartbeat_s <= 0:
            raise ValueError("heartbeat interval must be > 0")
        if self.keep is not None and self.keep < 1:
            raise ValueError("keep must be >= 1")
        if self.secure and "shared" in self.connections:
            raise ValueError(
                "one shared connection cannot carry many agents' identities: "
                "--secure measures own and node connections only"
            )
        if self.secure and "distribution" in self.series:
            raise ValueError(
                "the distribution series runs on plain NATS (it reads the server's "
                "monitoring endpoint and clears the adapter store between updates)"
            )
        for plain in ("tenants", "placement"):
            if self.secure and plain in self.series:
                raise ValueError(f"the {plain} series runs on plain NATS")

    def updates_for(self, case: str) -> int:
        if case != "window":
            return self.updates
        return self.window_updates or max(5, self.updates // 2)

    def keep_versions(self) -> int:
        """More versions than a series commits, unless ``keep`` says otherwise."""
        if self.keep is not None:
            return self.keep
        return self.warmup + max(self.updates, self.updates_for("window")) + 1

    def heartbeat_for(self, n: int) -> float:
        """Every agent of the bench shares 2 cores, where in production each has a
        node: a fleet-wide beat rate of about 128/s keeps that background load
        from swamping the machine (the coordinator's cost per beat is reported)."""
        return self.heartbeat_s if self.heartbeat_s is not None else max(1.0, n / 128)

    def world_sizes_for(self, n: int) -> list[int]:
        return [self.world_sizes[i % len(self.world_sizes)] for i in range(n)]


FULL = BenchConfig()
"""``lorabus bench``: every size and mode, both connection layouts, the window case."""
QUICK = BenchConfig(
    sizes=QUICK_SIZES,
    updates=5,
    warmup=1,
    window_case=None,
    connections=("own",),
    idle_s=0.5,
    label="quick",
    distribution=DistributionCase(sizes=(8,), adapter_mb=(16,)),
    tenants=TenantsCase(tenants=(1, 8), sizes=(64,), seconds=5.0, warmup=1),
    placement=PlacementCase(tenants=16, sizes=(16,), rounds=2),
)
"""``lorabus bench --quick``: sizes up to 256, fewer updates, own connections only;
the distribution series at N = 8 with a 16 MB adapter; the tenants series at
N = 64 with 1 and 8 tenants, 5 s each; the placement series at N = 16 with 16
tenants."""
