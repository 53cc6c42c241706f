"""CPU seconds and memory of a process, read from the kernel (Linux).

The benchmark measures each part in its own process, so "CPU per update" is
the difference of two readings of that process's user + system time, and
"peak RSS" is the kernel's high-water mark (``VmHWM`` in ``/proc/<pid>/status``),
which covers the whole life of the process.

CPU time is read from the process's CPU-time clock, which Linux offers for any
process: the clock id that glibc's ``clock_getcpuclockid`` builds,
``(~pid << 3) | CPUCLOCK_SCHED``, read with ``clock_gettime``; it counts in
nanoseconds, where ``/proc/<pid>/stat`` (the fallback) counts 10 ms ticks.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_CPUCLOCK_SCHED = 2


class ProcessGone(Exception):
    """Raised when the process to read has exited."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used so far (all its threads)."""
    try:
        return time.clock_gettime((~pid << 3) | _CPUCLOCK_SCHED)
    except (OSError, OverflowError):
        pass  # gone, or a kernel without process CPU clocks: /proc tells which
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError as exc:
        raise ProcessGone(f"process {pid} is gone") from exc
    # The command name (field 2) may hold spaces: split after its closing ')'.
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def memory_mb(pid: int) -> tuple[float, float]:
    """``(rss, peak rss)`` of ``pid`` in MiB."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as exc:
        raise ProcessGone(f"process {pid} is gone") from exc
    values = {}
    for line in lines:
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            values[name] = int(rest.split()[0]) / 1024
    return values.get("VmRSS", 0.0), values.get("VmHWM", 0.0)


def peak_rss_mb(pid: int) -> float:
    return memory_mb(pid)[1]


def machine_busy_seconds() -> float:
    """CPU seconds every core of the machine has spent busy so far (``/proc/stat``)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait.
    values = [int(v) for v in fields[:8]]
    return (sum(values) - values[3] - values[4]) * _TICK_S


class ForeignLoad:
    """How busy the rest of the machine was while some processes were measured.

    The benchmark shares its machine with whatever else runs there; the share
    of all cores that went to other processes during a timed series tells a
    run disturbed by them from a slow one.
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._started = self._read()

    def _read(self) -> tuple[float, float, float]:
        own = time.process_time()
        for pid in self.pids:
            try:
                own += cpu_seconds(pid)
            except ProcessGone:
                pass
        return machine_busy_seconds(), own, time.monotonic()

    def share(self) -> float | None:
        """Share of all cores used by other processes since this was made; None
        for less than a second, which the 10 ms ticks of ``/proc/stat`` blur."""
        busy0, own0, t0 = self._started
        busy1, own1, t1 = self._read()
        cores = os.cpu_count() or 1
        if t1 - t0 < 1.0:
            return None
        return round(max(0.0, (busy1 - busy0) - (own1 - own0)) / ((t1 - t0) * cores), 3)
