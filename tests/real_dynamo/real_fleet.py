"""A real NVIDIA Dynamo 1.6.1 frontend and LoRA workers on loopback, for tests.

:func:`find_install` locates what ``scripts/install-real-dynamo`` built (its
virtualenv, tiny model and stamp file) or says why it is missing.
:class:`DynamoFleet` starts ``python -m dynamo.frontend`` and one
``lora_worker.py`` per worker with that virtualenv's python, all on
127.0.0.1 with file discovery, the TCP request plane and the ZMQ event plane,
in a fresh ``HOME`` and ``DYN_FILE_KV`` directory, and waits (polling with a
deadline) until every worker is healthy and the frontend discovers all of
them. :meth:`DynamoFleet.stop` sends SIGTERM to every process, SIGKILL to
any still there after a deadline, and waits for each.

It is synchronous (``subprocess``) so that one fleet can outlive the event
loops of the async tests that share it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lorabus.testbed.natsserver import free_port

REPO = Path(__file__).resolve().parents[2]
WORKER_SCRIPT = Path(__file__).with_name("lora_worker.py")
INSTALL_DIR_ENV = "LORABUS_REAL_DYNAMO_DIR"
#: What the stamp of a complete install says (scripts/install-real-dynamo).
STAMP_PREFIX = "ai-dynamo-runtime==1.6.1\nai-dynamo==1.6.1\n"
BASE_MODEL = "tiny"
LOAD_DELAY_ENV = "LORA_WORKER_LOAD_DELAY_S"
STOP_DEADLINE_S = 10.0
READY_DEADLINE_S = 90.0


@dataclass(frozen=True)
class Install:
    root: Path
    python: Path
    model: Path


def find_install() -> tuple[Install | None, str]:
    """The installed Dynamo environment, or None and why it is not usable."""
    root = Path(os.environ.get(INSTALL_DIR_ENV) or REPO / ".real-dynamo")
    stamp = root / "stamp"
    install = Install(root, root / "venv" / "bin" / "python", root / "model")
    if not stamp.is_file():
        return None, f"no real Dynamo install at {root} (run scripts/install-real-dynamo)"
    if not stamp.read_text().startswith(STAMP_PREFIX):
        return None, f"the Dynamo install at {root} is not the pinned 1.6.1 (re-run the script)"
    if not install.python.exists() or not (install.model / "config.json").is_file():
        return None, f"the Dynamo install at {root} is incomplete (re-run the script)"
    return install, ""


@dataclass
class DynamoProcess:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    #: The worker's system server, for workers.
    system_url: str | None = None
    stopped: bool = False

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def describe(self) -> str:
        code = self.process.poll()
        state = "running" if code is None else f"exited {code}"
        where = f"{self.name} (pid {self.process.pid}, {state}), log {self.log_path}"
        return f"{where}:\n{self.log_tail()}"

    def kill(self) -> None:
        """SIGKILL, like a crashed host, and wait."""
        self.stopped = True
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait()

    def stop(self, deadline_s: float = STOP_DEADLINE_S) -> None:
        """SIGTERM, SIGKILL after ``deadline_s``; always waited."""
        self.stopped = True
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(deadline_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process.wait()


@dataclass
class DynamoFleet:
    """A real Dynamo frontend plus ``worker_ids`` LoRA workers."""

    install: Install
    workdir: Path
    worker_ids: Sequence[str]
    #: Extra environment per worker id (e.g. a slow load for one of them).
    worker_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    router_mode: str = "kv"
    """The frontend's ``--router-mode``."""
    modes: Mapping[str, str] = field(default_factory=dict)
    """Worker id -> ``prefill`` or ``decode`` (disaggregated serving); else aggregated."""
    frontend: DynamoProcess | None = None
    workers: dict[str, DynamoProcess] = field(default_factory=dict)
    http_port: int = 0
    rl_port: int = 0

    @property
    def frontend_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def rl_url(self) -> str:
        return f"http://127.0.0.1:{self.rl_port}"

    def system_url(self, worker_id: str) -> str:
        url = self.workers[worker_id].system_url
        assert url is not None
        return url

    def _base_env(self) -> dict[str, str]:
        home = self.workdir / "home"
        kv = self.workdir / "discovery"
        home.mkdir(parents=True, exist_ok=True)
        kv.mkdir(parents=True, exist_ok=True)
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("DYN_", "VIRTUAL_ENV", "PYTHON"))
        }
        env.update(
            HOME=str(home),
            DYN_DISCOVERY_BACKEND="file",
            DYN_FILE_KV=str(kv),
            DYN_REQUEST_PLANE="tcp",
            DYN_EVENT_PLANE="zmq",
            DYN_NAMESPACE="dynamo",
            DYN_TCP_RPC_HOST="127.0.0.1",
            DYN_EVENT_PLANE_HOST="127.0.0.1",
            DYN_SYSTEM_HOST="127.0.0.1",
            DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
            DYN_HTTP_HOST="127.0.0.1",
            DYN_LOG="warn,lora_worker=info,dynamo_runtime::pipeline::network::ingress=info",
        )
        return env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> DynamoProcess:
        log_path = self.workdir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
            )
        return DynamoProcess(name, process, log_path)

    def start(self) -> None:
        """Start the frontend and the workers and wait until the frontend sees them all."""
        python = str(self.install.python)
        self.http_port, self.rl_port = free_port(), free_port()
        env = self._base_env()
        frontend_env = {
            **env,
            "DYN_LORA_ENABLED": "true",
            "DYN_LORA_ALLOCATION_ENABLED": "false",
            "DYN_ENABLE_RL": "true",
            "DYN_RL_PORT": str(self.rl_port),
        }
        argv = [python, "-m", "dynamo.frontend", "--http-port", str(self.http_port)]
        argv += ["--router-mode", self.router_mode]
        self.frontend = self._spawn("frontend", argv, frontend_env)
        for worker_id in self.worker_ids:
            port = free_port()
            worker_env = {
                **env,
                "DYN_LORA_ENABLED": "true",
                "DYN_SYSTEM_PORT": str(port),
                **self.worker_env.get(worker_id, {}),
            }
            argv = [python, str(WORKER_SCRIPT), "--model-path", str(self.install.model)]
            argv += ["--model-name", BASE_MODEL]
            argv += ["--disaggregation-mode", self.modes.get(worker_id, "agg")]
            worker = self._spawn(f"worker-{worker_id}", argv, worker_env)
            worker.system_url = f"http://127.0.0.1:{port}"
            self.workers[worker_id] = worker
        self._wait_ready()

    def _all(self) -> list[DynamoProcess]:
        return [p for p in [self.frontend, *self.workers.values()] if p is not None]

    def check_alive(self) -> None:
        dead = [p for p in self._all() if p.process.poll() is not None and not p.stopped]
        if dead:
            raise AssertionError("a Dynamo process died:\n" + "\n".join(p.describe() for p in dead))

    def _wait_ready(self) -> None:
        with httpx.Client(timeout=2.0) as http:

            def ready() -> bool:
                for worker_id in self.worker_ids:
                    health = http.get(f"{self.system_url(worker_id)}/health")
                    if health.status_code != 200:
                        return False
                    if http.get(f"{self.system_url(worker_id)}/v1/loras").status_code != 200:
                        return False
                found = {w.get("system_url") for w in self.rl_workers(http)}
                if not {self.system_url(w) for w in self.worker_ids} <= found:
                    return False
                models = http.get(f"{self.frontend_url}/v1/models").json()
                return BASE_MODEL in {m["id"] for m in models["data"]}

            self.wait_until(ready, "the frontend to discover every healthy worker")

    def rl_workers(self, http: httpx.Client) -> list[dict[str, Any]]:
        workers: list[dict[str, Any]] = http.get(f"{self.rl_url}/v1/rl/workers").json()["workers"]
        return workers

    def wait_until(
        self, condition: Callable[[], bool], what: str, deadline_s: float = READY_DEADLINE_S
    ) -> None:
        """Poll ``condition`` until true; fail with the processes' logs at the deadline."""
        deadline = time.monotonic() + deadline_s
        last_error = "not yet"
        while True:
            self.check_alive()
            try:
                if condition():
                    return
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                logs = "\n".join(p.describe() for p in self._all())
                raise AssertionError(
                    f"waited {deadline_s:.0f}s for {what}; last error: {last_error}\n{logs}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop workers first (they unregister), then the frontend."""
        for process in self.workers.values():
            if process.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.process.send_signal(signal.SIGTERM)
        for process in self.workers.values():
            process.stop()
        if self.frontend is not None:
            self.frontend.stop()
