"""The processes of a benchmark run: started, asked, and always reaped.

Each measured part runs in a process of its own so that its CPU time and peak
RSS are its own: the coordinator (the real ``lorabus coordinator``), the
agent hosts, the simulated fleet and the direct-HTTP baseline. Bench children
(``python -m lorabus.bench.<module> <spec>``) are asked JSON questions over
their stdin and answer on stdout (see ``control.py``); ``lorabus`` children
are only watched. :class:`Children` stops every child it started: ``stop``
on stdin or SIGTERM, SIGKILL after a deadline, and always a wait; on Linux
the kernel also kills them should the benchmark itself die first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

LORABUS = str(Path(sys.executable).parent / "lorabus")
_STOP_DEADLINE_S = 10.0
_PR_SET_PDEATHSIG = 1
_LINE_LIMIT = 1 << 24


class ChildFailed(Exception):
    """Raised when a child dies, answers an error, or does not answer in time."""


def _die_with_parent() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_pdeathsig() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return set_pdeathsig


_PREEXEC = _die_with_parent()


class Child:
    def __init__(self, name: str, process: asyncio.subprocess.Process, log_path: Path) -> None:
        self.name = name
        self.process = process
        self.log_path = log_path
        self.asks = process.stdin is not None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    async def read(self, timeout_s: float) -> dict[str, Any]:
        """The child's next JSON line."""
        assert self.process.stdout is not None, "a bench child"
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), timeout_s)
        except TimeoutError:
            raise ChildFailed(
                f"{self.name} did not answer within {timeout_s:.0f}s; its log:\n{self.log_tail()}"
            ) from None
        if not line:
            await self.process.wait()
            raise ChildFailed(
                f"{self.name} exited ({self.process.returncode}); its log:\n{self.log_tail()}"
            )
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise ChildFailed(f"{self.name}: {answer['error']}")
        return answer

    async def ask(self, op: str, timeout_s: float = 60.0, **fields: Any) -> dict[str, Any]:
        assert self.process.stdin is not None, "a bench child"
        self.process.stdin.write((json.dumps({"op": op, **fields}) + "\n").encode())
        await self.process.stdin.drain()
        return await self.read(timeout_s)


class Children:
    """Starts children with their stderr in ``log_dir``; stops them all on exit."""

    def __init__(self, log_dir: Path, env: Mapping[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = dict(env) if env is not None else None
        self.children: list[Child] = []

    async def __aenter__(self) -> Children:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def bench_child(
        self,
        name: str,
        module: str,
        spec: Mapping[str, Any],
        *,
        ready_timeout_s: float = 60.0,
        env: Mapping[str, str] | None = None,
    ) -> tuple[Child, dict[str, Any]]:
        """Start ``python -m lorabus.bench.<module> <spec>``; return it and its ready line."""
        argv = [sys.executable, "-m", f"lorabus.bench.{module}", json.dumps(spec)]
        child = await self._spawn(name, argv, asks=True, env=env)
        try:
            ready = await child.read(ready_timeout_s)
        except BaseException:
            await self.stop(child)
            raise
        return child, ready

    async def lorabus(self, name: str, args: list[str], *, log_level: str = "WARNING") -> Child:
        """Start ``lorabus --log-level L <args>``."""
        return await self._spawn(name, [LORABUS, "--log-level", log_level, *args], asks=False)

    async def _spawn(
        self, name: str, argv: list[str], *, asks: bool, env: Mapping[str, str] | None = None
    ) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        child_env = None
        if env is not None or self.env is not None:
            child_env = {**os.environ, **(self.env or {}), **(env or {})}
        with log_path.open("ab") as stderr:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if asks else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE if asks else asyncio.subprocess.DEVNULL,
                stderr=stderr,
                env=child_env,
                preexec_fn=_PREEXEC,
                limit=_LINE_LIMIT,
            )
        child = Child(name, process, log_path)
        self.children.append(child)
        log.info("started %s (pid %d)", name, child.pid)
        return child

    async def stop(self, child: Child, deadline_s: float = _STOP_DEADLINE_S) -> None:
        """Ask it to stop (stdin) or SIGTERM it; SIGKILL after ``deadline_s``; wait."""
        if child.running:
            if child.asks and child.process.stdin is not None:
                with contextlib.suppress(Exception):
                    child.process.stdin.write(b'{"op": "stop"}\n')
                    child.process.stdin.close()
            else:
                with contextlib.suppress(ProcessLookupError):
                    child.process.terminate()
            try:
                await asyncio.wait_for(asyncio.shield(child.process.wait()), deadline_s)
            except TimeoutError:
                log.warning("%s (pid %d) did not stop: killing it", child.name, child.pid)
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
        await child.process.wait()
        with contextlib.suppress(ValueError):
            self.children.remove(child)

    async def stop_all(self, children: list[Child]) -> None:
        """Stop ``children`` together (each within its own deadline)."""
        await asyncio.gather(*(self.stop(child) for child in children))

    async def aclose(self) -> None:
        # On Ctrl-C the children must still be reaped before the cancellation goes on.
        left = list(self.children)
        if not left:
            return
        stopping = asyncio.ensure_future(self.stop_all(left))
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            await stopping
            raise
