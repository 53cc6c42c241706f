"""compose.yaml's stack under test: built, brought up and taken down with podman-compose.

Each stack gets a project name of its own and free host ports, so it neither
meets another run's stack nor needs ports someone else may hold. Containers are
found by the labels podman-compose puts on them, not by guessing their names.
Every command runs under a deadline, so a stuck engine fails the test instead
of hanging it.

:func:`runtime_missing` says why the tier cannot run here (no podman, no base
image, no podman-compose); ``scripts/setup-containers`` prepares all three.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from processes import run_lorabus

from lorabus.testbed.natsserver import free_port

REPO = Path(__file__).resolve().parent.parent
BASE_IMAGE = os.environ.get("LORABUS_BASE_IMAGE", "localhost/debian:bookworm")
PROJECT_LABEL = "io.podman.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
SETUP_HINT = "run scripts/setup-containers (as root) to prepare podman and the base image"


def podman(*args: str, timeout: float = 60.0, check: bool = True) -> str:
    done = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}:\n{done.stderr}")
    return done.stdout


def container_log(name: str, tail: int | None = None) -> str:
    """What a container wrote (its last ``tail`` lines), stderr included: lorabus logs there."""
    last = ["--tail", str(tail)] if tail is not None else []
    done = subprocess.run(
        ["podman", "logs", *last, name], capture_output=True, text=True, timeout=60, check=False
    )
    return done.stdout + done.stderr


def runtime_missing() -> str | None:
    """Why containers cannot be built and run here, or None when they can."""
    if shutil.which("podman") is None:
        return f"no podman on PATH: {SETUP_HINT}"
    if importlib.util.find_spec("podman_compose") is None:
        return "podman-compose is not installed: pip install -e '.[test]'"
    try:
        info = subprocess.run(["podman", "info"], capture_output=True, text=True, timeout=30)
        exists = subprocess.run(["podman", "image", "exists", BASE_IMAGE], timeout=30)
    except subprocess.TimeoutExpired:
        return "podman did not answer within 30 s"
    if info.returncode != 0:
        return f"podman info failed ({info.stderr.strip()[:200]}): {SETUP_HINT}"
    if exists.returncode != 0:
        return f"no base image {BASE_IMAGE}: {SETUP_HINT}"
    return None


class ComposeStack:
    """One project of compose.yaml (and any overlays), with its own name and host ports.

    ``files`` are the compose files in order (``-f`` each, later ones overlay
    earlier ones); ``profiles`` the profiles enabled (``--profile`` each), so
    that a profile's services are also taken down with the rest."""

    def __init__(
        self,
        image: str,
        *,
        sim_load_latency: float = 0.0,
        files: Sequence[str] = ("compose.yaml",),
        profiles: Sequence[str] = (),
    ) -> None:
        self.project = f"lbtest{uuid.uuid4().hex[:8]}"
        self.image = image
        self.files = tuple(files)
        self.profiles = tuple(profiles)
        self.nats_ports = [free_port() for _ in range(3)]
        self.sim_port = free_port()
        self.env = {
            **os.environ,
            "LORABUS_IMAGE": image,
            "LORABUS_BASE_IMAGE": BASE_IMAGE,
            "LORABUS_NATS_PORT_1": str(self.nats_ports[0]),
            "LORABUS_NATS_PORT_2": str(self.nats_ports[1]),
            "LORABUS_NATS_PORT_3": str(self.nats_ports[2]),
            "LORABUS_SIM_PORT": str(self.sim_port),
            "LORABUS_SIM_LOAD_LATENCY": str(sim_load_latency),
        }

    @property
    def nats_url(self) -> str:
        """All three nodes, as the host reaches them through the published ports."""
        return ",".join(f"nats://127.0.0.1:{port}" for port in self.nats_ports)

    @property
    def sim_url(self) -> str:
        return f"http://127.0.0.1:{self.sim_port}"

    def compose_argv(self, *args: str) -> list[str]:
        argv = [sys.executable, "-m", "podman_compose", "-p", self.project]
        for file in self.files:
            argv += ["-f", file]
        for profile in self.profiles:
            argv += ["--profile", profile]
        return [*argv, *args]

    def compose_run(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """``podman-compose <args>`` to completion (or the deadline), whatever its exit."""
        return subprocess.run(
            self.compose_argv(*args),
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def compose(self, *args: str, timeout: float = 120.0) -> str:
        done = self.compose_run(*args, timeout=timeout)
        if done.returncode != 0:
            raise AssertionError(
                f"podman-compose {' '.join(args)} exited {done.returncode}:\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done.stdout

    def build(self, version: str) -> None:
        self.env["LORABUS_VERSION"] = version
        self.compose("build", timeout=600)

    def up(self) -> None:
        self.compose("up", "-d", timeout=180)

    def containers(self) -> dict[str, dict[str, str]]:
        """Every container of the project, running or not: service -> {name, state}."""
        label = f"label={PROJECT_LABEL}={self.project}"
        listed = json.loads(podman("ps", "-a", "--filter", label, "--format", "json") or "[]")
        return {
            c["Labels"][SERVICE_LABEL]: {"name": c["Names"][0], "state": c["State"]} for c in listed
        }

    def container(self, service: str) -> str:
        return self.containers()[service]["name"]

    def stop(self, service: str) -> None:
        podman("stop", "--time", "5", self.container(service))

    def logs(self, service: str) -> str:
        return container_log(self.container(service), tail=40)

    def full_logs(self) -> dict[str, str]:
        """Every container's whole log (stdout and stderr, across restarts): service -> text."""
        return {
            service: container_log(c["name"]) for service, c in sorted(self.containers().items())
        }

    def copy_out(self, service: str, path: str, dest: Path) -> Path:
        """Copy ``path`` (a file or folder) out of ``service``'s container to ``dest``."""
        podman("cp", f"{self.container(service)}:{path}", str(dest))
        return dest

    def all_logs(self) -> str:
        """The tail of every service's log, for a failure message."""
        return "\n".join(
            f"--- {service}\n{container_log(c['name'], tail=30)}"
            for service, c in sorted(self.containers().items())
        )

    def sim_requests(self) -> str:
        """Each simulated worker's control requests, when and what, for a failure message."""
        lines = []
        try:
            for worker in httpx.get(f"{self.sim_url}/sim/workers", timeout=10).json():
                worker_id = worker["worker_id"]
                url = f"{self.sim_url}/sim/workers/{worker_id}/requests"
                for r in httpx.get(url, timeout=10).json():
                    lines.append(f"{r['ts']:.3f} {worker_id} {r['method']} {r['path']}")
        except httpx.HTTPError as exc:
            lines.append(f"(the simulated fleet did not answer: {exc!r})")
        return "\n".join(sorted(lines))

    def read_trail(self, dest: Path) -> str:
        """Copy the tap's trail file out of its volume to ``dest``; return its text."""
        podman("cp", f"{self.container('tap')}:/trail/trail.jsonl", str(dest))
        return dest.read_text()

    def down(self) -> None:
        self.compose("down", "-v", "--timeout", "5", timeout=180)

    def remove_leftovers(self) -> None:
        """Force away whatever ``down`` left of the project (a ``run`` container a
        deadline cut short, a volume still in use), so no failed test leaves any."""
        label = f"label={PROJECT_LABEL}={self.project}"
        for name in podman("ps", "-a", "--filter", label, "--format", "{{.Names}}").split():
            podman("rm", "-f", "--time", "2", name, check=False)
        for kind_and_name in self.leftovers():
            kind, name = kind_and_name.split(" ", 1)
            if kind != "container":
                podman(kind, "rm", "-f", name, check=False)

    def leftovers(self) -> list[str]:
        """Containers, networks and volumes of the project that still exist."""
        found: list[str] = []
        label = f"label={PROJECT_LABEL}={self.project}"
        found += [f"container {n}" for n in self.containers()]
        for kind in ("network", "volume"):
            listed = podman(kind, "ls", "--format", "{{.Name}}").split()
            labelled = podman(kind, "ls", "--filter", label, "--format", "{{.Name}}").split()
            named = {n for n in listed if n.startswith(self.project)}
            found += [f"{kind} {name}" for name in sorted(set(labelled) | named)]
        return found


async def update_from_host(
    stack: ComposeStack, *source: str, fleet: str = "default", timeout_s: float = 90.0
) -> dict[str, Any]:
    """``lorabus update --adapter policy <source> --json`` from the host through
    the published ports, as the README says; its JSON result."""
    finished = await run_lorabus(
        "update",
        "--adapter",
        "policy",
        *source,
        "--timeout",
        f"{timeout_s:g}",
        "--json",
        env={"LORABUS_NATS_URL": stack.nats_url, "LORABUS_FLEET": fleet},
        deadline_s=timeout_s + 30,
    )
    return dict(json.loads(finished.stdout))
