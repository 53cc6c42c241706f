"""The processes of a benchmark run: started, asked, and always reaped.

Each measured part runs in a process of its own so that its CPU time and peak
RSS are its own: the coordinator (the real ``lorabus coordinator``), the
agent hosts, the simulated fleet and the direct-HTTP baseline. Bench children
(``python -m lorabus.testbed.bench.<module> <spec>``) are asked JSON questions over
their stdin and answer on stdout (see ``control.py``); ``lorabus`` children
are only watched. :class:`Children` stops every child it started (with
:mod:`lorabus.testbed.child_processes`): ``stop`` on stdin or SIGTERM, SIGKILL after a
deadline, and always a wait; on Linux the kernel also kills them should the
benchmark itself die first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lorabus.testbed.child_processes import LORABUS, ChildGroup, ChildProcess, child_env

# An agent host winds down many agents, each resuming its engine, before it exits.
_STOP_DEADLINE_S = 10.0
# One answer (an agent host's engine times) is one line, however long.
_LINE_LIMIT = 1 << 24


class ChildFailed(Exception):
    """Raised when a child dies, answers an error, or does not answer in time."""


class Child(ChildProcess):
    """A bench child (stdin and stdout are its protocol) or a watched ``lorabus`` one."""

    @property
    def asks(self) -> bool:
        return self.process.stdin is not None

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

    def request_stop(self) -> None:
        if self.process.stdin is None:
            super().request_stop()
            return
        # A closed pipe means it is already going.
        with contextlib.suppress(Exception):
            self.process.stdin.write(b'{"op": "stop"}\n')
            self.process.stdin.close()


class Children(ChildGroup[Child]):
    """Starts children with their stderr in ``log_dir``; stops them all on exit."""

    def __init__(self, log_dir: Path, env: Mapping[str, str] | None = None) -> None:
        super().__init__(stop_deadline_s=_STOP_DEADLINE_S)
        self.log_dir = log_dir
        self.env = dict(env or {})

    async def bench_child(
        self,
        name: str,
        module: str,
        spec: Mapping[str, Any],
        *,
        ready_timeout_s: float = 60.0,
        env: Mapping[str, str] | None = None,
    ) -> tuple[Child, dict[str, Any]]:
        """Start ``python -m lorabus.testbed.bench.<module> <spec>``; return it and its
        ready line."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        spec_file = self.log_dir / f"{name}.spec.json"
        spec_file.write_text(json.dumps(spec))
        argv = [sys.executable, "-m", f"lorabus.testbed.bench.{module}", str(spec_file)]
        child = await self._spawn(name, argv, asks=True, env=env)
        try:
            ready = await child.read(ready_timeout_s)
        except BaseException:
            await self.stop(child)
            raise
        return child, ready

    async def lorabus(
        self,
        name: str,
        args: list[str],
        *,
        log_level: str = "WARNING",
        env: Mapping[str, str] | None = None,
    ) -> Child:
        """Start ``lorabus --log-level L <args>`` (``env``: more variables, such as
        ``LORABUS_IDENTITY``)."""
        argv = [LORABUS, "--log-level", log_level, *args]
        return await self._spawn(name, argv, asks=False, env=env)

    async def _spawn(
        self, name: str, argv: list[str], *, asks: bool, env: Mapping[str, str] | None = None
    ) -> Child:
        child = await Child.spawn(
            name,
            argv,
            self.log_dir / f"{name}.log",
            env=child_env({**self.env, **(env or {})}),
            pipes=asks,
            line_limit=_LINE_LIMIT,
        )
        return self.adopt(child)
