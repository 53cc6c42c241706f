"""Child processes that never outlive their owner.

The benchmark, the chaos suite and the tests run parts of lorabus as OS
processes of their own: a kill must be a real kill, and a measured part's CPU
time and memory must be its own. They share what makes that safe, here.

A :class:`ChildProcess` is started with its stderr appended to a log file and,
on Linux, asks the kernel for SIGKILL should its parent die first, so not even
a crashed owner leaves one behind. :meth:`ChildProcess.stop` continues it if
it was suspended (a stopped process cannot act on SIGTERM), asks it to stop,
SIGKILLs it after a deadline, and always waits for it. A :class:`ChildGroup`
owns the children it adopts and stops every one still running when it is
closed, also when the closing is cancelled (Ctrl-C).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Generic, Self, TypeVar

log = logging.getLogger(__name__)

LORABUS = str(Path(sys.executable).parent / "lorabus")
"""The ``lorabus`` command of the environment this Python runs in."""

STOP_DEADLINE_S = 5.0
"""Seconds a child gets to exit once asked, before it is killed."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_LINE_LIMIT = 1 << 16  # asyncio's default for a line read from a pipe


def child_env(overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment with ``overrides`` applied; a None value removes a name."""
    env = dict(os.environ)
    for name, value in (overrides or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn that has the kernel SIGKILL the child when its parent dies."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_pdeathsig() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return set_pdeathsig


# The kernel sends the signal when the forking *thread* exits; asyncio forks
# from the event loop's thread, which lives as long as the children's owner.
_PREEXEC = _parent_death_signal()


@dataclass(eq=False)
class ChildProcess:
    """One started child; subclasses add what their owner needs to know of it."""

    name: str
    argv: list[str]
    process: asyncio.subprocess.Process
    log_path: Path
    suspended: bool = False
    ended_on_purpose: bool = False
    """Set once it was stopped or killed on purpose: any other exit is a crash."""

    @classmethod
    async def spawn(
        cls,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        pipes: bool = False,
        line_limit: int = _LINE_LIMIT,
    ) -> Self:
        """Start ``argv`` with its stderr appended to ``log_path``.

        Its stdin and stdout are pipes with ``pipes``, /dev/null otherwise;
        ``env`` None inherits this process's environment.
        """
        log_path.parent.mkdir(parents=True, exist_ok=True)
        stdio = asyncio.subprocess.PIPE if pipes else asyncio.subprocess.DEVNULL
        with log_path.open("ab") as stderr:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=stdio,
                stdout=stdio,
                stderr=stderr,
                env=env,
                preexec_fn=_PREEXEC,
                limit=line_limit,
            )
        child = cls(name, list(argv), process, log_path)
        log.info("started %s (pid %d)", name, child.pid)
        return child

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def describe(self, lines: int = 30) -> str:
        state = "running" if self.running else f"exited {self.returncode}"
        return (
            f"{self.name} (pid {self.pid}, {state}); log {self.log_path}:\n{self.log_tail(lines)}"
        )

    def suspend(self) -> None:
        """SIGSTOP: alive but silent, like a host that froze."""
        self._signal(signal.SIGSTOP)
        self.suspended = True

    def resume(self) -> None:
        self._signal(signal.SIGCONT)
        self.suspended = False

    async def kill(self) -> int:
        """SIGKILL and wait: no chance to clean up, like a crashed host."""
        self.ended_on_purpose = True
        self._signal(signal.SIGKILL)
        code = await self.process.wait()
        self.suspended = False
        return code

    async def stop(self, deadline_s: float = STOP_DEADLINE_S) -> int:
        """Continue it if suspended, ask it to stop, SIGKILL after ``deadline_s``; always waited."""
        self.ended_on_purpose = True
        if self.running:
            if self.suspended:
                self.resume()
            self.request_stop()
            try:
                await asyncio.wait_for(asyncio.shield(self.process.wait()), deadline_s)
            except TimeoutError:
                log.warning(
                    "%s (pid %d) did not stop within %.0fs: killing it",
                    self.name,
                    self.pid,
                    deadline_s,
                )
                self._signal(signal.SIGKILL)
            except asyncio.CancelledError:
                # Whoever gave up on the stop must still not leave the child behind.
                self._signal(signal.SIGKILL)
                await self.process.wait()
                raise
        return await self.process.wait()

    def request_stop(self) -> None:
        """SIGTERM; a child that can be asked some other way overrides this."""
        self._signal(signal.SIGTERM)

    def _signal(self, signum: int) -> None:
        # It may have exited since it was last looked at.
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signum)


ChildT = TypeVar("ChildT", bound=ChildProcess)


class ChildGroup(Generic[ChildT]):
    """The owner of the children it adopts: closing it stops every one still running."""

    def __init__(self, *, stop_deadline_s: float = STOP_DEADLINE_S) -> None:
        self.children: list[ChildT] = []
        self.stop_deadline_s = stop_deadline_s

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def adopt(self, child: ChildT) -> ChildT:
        self.children.append(child)
        return child

    async def stop(self, child: ChildT) -> int:
        return await child.stop(self.stop_deadline_s)

    async def stop_all(self, children: Iterable[ChildT]) -> None:
        """Stop ``children`` together; the first error is raised once all were waited for."""
        results = await asyncio.gather(
            *(self.stop(child) for child in children), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def aclose(self) -> None:
        """Stop every child still running, concurrently; each one is waited for."""
        stopping = asyncio.ensure_future(self.stop_all([c for c in self.children if c.running]))
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            # On Ctrl-C the children must still be reaped before the cancellation goes on.
            await stopping
            raise
