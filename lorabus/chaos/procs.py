"""Child processes of a chaos run: started, signalled, and always reaped.

Kills must be real, so agents and coordinators run as ``lorabus`` OS
processes. Every child started here is stopped by :meth:`ProcessGroup.aclose`
(also on Ctrl-C, through the runner's ``async with``): SIGCONT first if it was
stopped (a stopped process cannot act on SIGTERM), SIGTERM, SIGKILL after a
deadline, and always a wait, so none outlives the run. On Linux each child
also asks the kernel for SIGKILL should the chaos process itself die first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

LORABUS = str(Path(sys.executable).parent / "lorabus")
STOP_DEADLINE_S = 5.0
_PR_SET_PDEATHSIG = 1


def _parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn that has the kernel SIGKILL the child when this process dies."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_pdeathsig() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return set_pdeathsig


_PREEXEC = _parent_death_signal()


@dataclass
class Child:
    name: str
    argv: list[str]
    process: asyncio.subprocess.Process
    log_path: Path
    started_at: float
    """``time.monotonic()`` when it was started."""
    suspended: bool = False
    ended_on_purpose: bool = False
    """Set once it was killed or told to stop: any other exit is a crash."""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])


class ProcessGroup:
    """Starts ``lorabus`` children with their stderr in ``log_dir``; reaps them all."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []
        self._counts: dict[str, int] = {}

    async def __aenter__(self) -> ProcessGroup:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self, name: str, args: Sequence[str], *, log_level: str = "INFO") -> Child:
        """Start ``lorabus --log-level L <args>``; its stderr goes to ``<log_dir>/<name>.N.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        count = self._counts[name] = self._counts.get(name, 0) + 1
        log_path = self.log_dir / f"{name}.{count}.log"
        argv = [LORABUS, "--log-level", log_level, *args]
        with log_path.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=stderr,
                preexec_fn=_PREEXEC,
            )
        child = Child(name, argv, process, log_path, time.monotonic())
        self.children.append(child)
        log.info("started %s (pid %d)", name, child.pid)
        return child

    async def kill(self, child: Child) -> None:
        """SIGKILL and wait: no chance to clean up, like a crashed host."""
        child.ended_on_purpose = True
        with contextlib.suppress(ProcessLookupError):
            child.process.kill()
        await child.process.wait()
        child.suspended = False

    def suspend(self, child: Child) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.process.send_signal(signal.SIGSTOP)
        child.suspended = True

    def resume(self, child: Child) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.process.send_signal(signal.SIGCONT)
        child.suspended = False

    async def terminate(self, child: Child, deadline_s: float = STOP_DEADLINE_S) -> int:
        """SIGCONT if stopped, SIGTERM, SIGKILL after ``deadline_s``; always waited."""
        child.ended_on_purpose = True
        if child.running:
            if child.suspended:
                self.resume(child)
            with contextlib.suppress(ProcessLookupError):
                child.process.terminate()
            try:
                await asyncio.wait_for(asyncio.shield(child.process.wait()), deadline_s)
            except TimeoutError:
                log.warning("%s (pid %d) ignored SIGTERM: killing it", child.name, child.pid)
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
        return await child.process.wait()

    async def aclose(self) -> None:
        """Stop every child still running, concurrently; each one is waited for."""
        running = [c for c in self.children if c.running]
        results = await asyncio.gather(
            *(self.terminate(c) for c in running), return_exceptions=True
        )
        for child, result in zip(running, results, strict=True):
            if isinstance(result, BaseException):
                log.error("could not stop %s (pid %d): %r", child.name, child.pid, result)
