"""The ``containers`` tier, adapters over the bus: compose.yaml with compose.bus.yaml,
run for real with podman, and no volume of adapters shared by anyone.

The trainer container writes its adapters in its own filesystem and pushes
them to the fleet's object store; each agent keeps what it fetches in a cache
volume of its own; the simulated fleet, standing in for the three nodes'
engines, reads each node's cache read-only. An update by the digest the
trainer printed, and one of an adapter pushed from the host (``lorabus adapter
push`` through the published ports, as a user would), commit with every
agent's cache volume holding the adapter under its digest, and the store
replicated on all three NATS nodes. One stack serves the module; the last test
takes it down and checks nothing of it is left. Skipped, with the reason,
where ``scripts/setup-containers`` has not prepared podman and the base image.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from compose_stack import ComposeStack, podman, runtime_missing, update_from_host
from nats_container import IMAGE
from processes import LORABUS, run_lorabus

from lorabus._version import __version__
from lorabus.adapters.digest import adapter_digest
from lorabus.bus.connect import close, connect
from lorabus.schemas import Subjects
from lorabus.testbed.trainer import write_adapter

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(600)]

FILES = ("compose.yaml", "compose.bus.yaml")
FLEET = "default"
#: Each agent's service -> its worker id; its cache volume is ``cache-<worker id>``.
AGENTS = {"agent-w000": "w000", "agent-w001": "w001", "agent-w002": "w002"}
READY_DEADLINE_S = 150.0
PUSHED = re.compile(r"^step_(\d+) (sha256:[0-9a-f]{64})$", re.MULTILINE)


@pytest.fixture(scope="module")
def stack() -> Iterator[ComposeStack]:
    """The stack, built from this checkout and up, with every agent live and a
    coordinator leading; taken down whatever happens."""
    reason = runtime_missing()
    if reason is not None:
        pytest.skip(reason)
    stack = ComposeStack(IMAGE, files=FILES)
    stack.build(__version__)
    try:
        stack.up()
        wait_fleet_ready(stack)
        yield stack
    finally:
        try:
            stack.down()
        finally:
            stack.remove_leftovers()


def lorabus_on(stack: ComposeStack) -> dict[str, str]:
    return {"LORABUS_NATS_URL": stack.nats_url, "LORABUS_FLEET": FLEET}


def wait_fleet_ready(stack: ComposeStack) -> None:
    give_up = time.monotonic() + READY_DEADLINE_S
    status: dict[str, Any] = {}
    while time.monotonic() < give_up:
        done = subprocess.run(
            [LORABUS, "status", "--json"],
            env={**stack.env, **lorabus_on(stack)},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        try:
            status = dict(json.loads(done.stdout))
        except json.JSONDecodeError:
            status = {"exit": done.returncode, "stderr": done.stderr[-500:]}
        ready = [m for m in status.get("members", []) if m.get("ready")]
        if status.get("leader") and len(ready) == len(AGENTS):
            return
        time.sleep(1)
    raise AssertionError(
        f"the compose fleet was not ready within {READY_DEADLINE_S:.0f}s; "
        f"last status: {status}\n{stack.all_logs()}"
    )


def wait_trainer_pushed(stack: ComposeStack, step: int) -> str:
    """The digest the trainer container printed for ``step`` once it pushed it."""
    give_up = time.monotonic() + READY_DEADLINE_S
    while time.monotonic() < give_up:
        log = podman("logs", stack.container("trainer"), check=False)
        pushed = {int(s): digest for s, digest in PUSHED.findall(log)}
        if step in pushed:
            return pushed[step]
        time.sleep(1)
    raise AssertionError(f"the trainer did not push step {step}:\n{stack.logs('trainer')}")


def mounts(stack: ComposeStack, service: str) -> list[dict[str, Any]]:
    """The volumes and binds mounted in ``service``'s container, as podman reports them."""
    inspected = json.loads(podman("inspect", stack.container(service)))[0]
    return list(inspected.get("Mounts") or [])


def volume_dir(stack: ComposeStack, worker: str) -> Path:
    """Where the cache volume of ``worker``'s agent is on this host."""
    name = f"{stack.project}_cache-{worker}"
    return Path(podman("volume", "inspect", name, "--format", "{{.Mountpoint}}").strip())


def cached(stack: ComposeStack, worker: str) -> dict[str, str]:
    """The entries of ``worker``'s cache volume: name -> the digest its files hash to."""
    root = volume_dir(stack, worker)
    return {
        item.name: adapter_digest(item)
        for item in root.iterdir()
        if re.fullmatch(r"[0-9a-f]{64}", item.name)
    }


def served_by_each_worker(stack: ComposeStack) -> dict[str, list[str]]:
    served = {}
    for worker in AGENTS.values():
        reply = httpx.get(f"{stack.sim_url}/workers/{worker}/v1/loras", timeout=10)
        reply.raise_for_status()
        served[worker] = sorted(reply.json()["loras"])
    return served


async def update_by_digest(stack: ComposeStack, digest: str) -> dict[str, Any]:
    return await update_from_host(stack, "--digest", digest, fleet=FLEET)


def test_no_volume_of_adapters_is_shared(stack: ComposeStack) -> None:
    """Each agent mounts its cache volume alone; the trainer and the
    coordinators mount nothing; the simulated engines read the caches only;
    no ``adapters`` volume exists."""
    found = {service: mounts(stack, service) for service in stack.containers()}
    volumes = podman("volume", "ls", "--format", "{{.Name}}").split()

    for service, worker in AGENTS.items():
        assert [(m["Name"], m["Destination"], m["RW"]) for m in found[service]] == [
            (f"{stack.project}_cache-{worker}", f"/caches/{worker}", True)
        ], found[service]
    for service in ("trainer", "coordinator-a", "coordinator-b"):
        assert found[service] == [], (service, found[service])
    assert sorted((m["Name"], m["RW"]) for m in found["sim"]) == [
        (f"{stack.project}_cache-{w}", False) for w in sorted(AGENTS.values())
    ]
    assert f"{stack.project}_adapters" not in volumes


async def test_an_update_by_the_digest_the_trainer_pushed_fills_every_cache(
    stack: ComposeStack,
) -> None:
    digest = wait_trainer_pushed(stack, 1)

    result = await update_by_digest(stack, digest)

    assert result["status"] == "committed", f"{result}\n{stack.all_logs()}"
    assert result["digest"] == digest and result["path"] == f"bus:{digest}"
    for worker in AGENTS.values():
        assert cached(stack, worker) == {digest.removeprefix("sha256:"): digest}, worker
    assert all(result["adapter"] in a for a in served_by_each_worker(stack).values())
    nc = await connect(stack.nats_url, name="test-containers-store")
    try:
        stream = f"OBJ_{Subjects(fleet=FLEET).adapter_store()}"
        store = await nc.jetstream().stream_info(stream)
    finally:
        await close(nc)
    assert store.config.num_replicas == 3
    assert store.cluster is not None and len(store.cluster.replicas or []) == 2, store.cluster


async def test_an_adapter_pushed_from_the_host_commits_into_every_cache(
    stack: ComposeStack, tmp_path: Path
) -> None:
    adapter = write_adapter(tmp_path / "host", 7, seed=1234)
    pushed = await run_lorabus(
        "adapter", "push", str(adapter), env=lorabus_on(stack), deadline_s=60
    )
    digest = pushed.stdout.strip()

    result = await update_by_digest(stack, digest)

    assert digest == adapter_digest(adapter), pushed
    assert result["status"] == "committed", f"{result}\n{stack.all_logs()}"
    assert result["digest"] == digest
    for worker in AGENTS.values():
        entries = cached(stack, worker)
        assert entries.get(digest.removeprefix("sha256:")) == digest, (worker, entries)
        assert all(name == found.removeprefix("sha256:") for name, found in entries.items())
    assert all(result["adapter"] in a for a in served_by_each_worker(stack).values())


def test_down_leaves_no_container_network_or_volume(stack: ComposeStack) -> None:
    stack.down()

    assert stack.leftovers() == []
