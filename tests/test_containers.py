"""The ``containers`` tier: the image and compose.yaml's stack, run for real with podman.

One stack serves the module, because bringing a three-node NATS cluster and
nine lorabus containers up costs tens of seconds on two cores; the tests run
in file order and each leaves the stack able to commit the next update (the
failover test leaves one coordinator, the NATS test two nodes). The last test
takes the stack down and checks nothing of it is left; the fixture takes it
down too when a test fails first.

Then compose.yaml with compose.auth.yaml, a project of its own: every service
as its own identity over mutual TLS, an update through the ``orchestrator``
service, no NATS permissions or authorization violation in any log, a client
without an identity refused, and nothing left after ``down -v``.

Everything crosses the boundaries a user crosses: ``lorabus`` on the host
through the published NATS ports, the simulated fleet through its published
HTTP port, podman for stopping containers. Skipped, with the reason, where
``scripts/setup-containers`` has not prepared podman and the base image.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from compose_stack import ComposeStack, podman, runtime_missing, update_from_host
from nats.aio.msg import Msg
from nats_container import IMAGE, PODMAN_SOCKET, nats_in_container
from processes import LORABUS, run_lorabus

from lorabus._version import __version__
from lorabus.bus.connect import close, connect
from lorabus.schemas import Subjects
from lorabus.testbed.stack import EmbeddedStack
from lorabus.testbed.trainer import write_adapter

pytestmark = [pytest.mark.containers, pytest.mark.slow, pytest.mark.timeout(600)]

FLEET = "default"
#: compose.yaml's simulated fleet: worker id -> world size, in rank order.
FLEET_WORLD_SIZES = {"w000": 2, "w001": 4, "w002": 1}
#: Seconds each simulated load takes: long enough that a NATS node can be
#: stopped while an update is still running.
LOAD_LATENCY_S = 3.0
READY_DEADLINE_S = 150.0


@pytest.fixture(scope="module")
def built() -> ComposeStack:
    """The image, built from this checkout by podman-compose (compose.yaml's build)."""
    reason = runtime_missing()
    if reason is not None:
        pytest.skip(reason)
    stack = ComposeStack(IMAGE, sim_load_latency=LOAD_LATENCY_S)
    stack.build(__version__)
    return stack


@pytest.fixture(scope="module")
def stack(built: ComposeStack) -> Iterator[ComposeStack]:
    """The stack, up, with every agent live and a coordinator leading."""
    try:
        built.up()
        wait_fleet_ready(built)
        yield built
    finally:
        try:
            built.down()
        finally:
            built.remove_leftovers()


def lorabus_json(stack: ComposeStack, *args: str, timeout: float = 60.0) -> dict[str, Any]:
    done = subprocess.run(
        [LORABUS, *args, "--json"],
        env={**stack.env, "LORABUS_NATS_URL": stack.nats_url, "LORABUS_FLEET": FLEET},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    try:
        return dict(json.loads(done.stdout))
    except json.JSONDecodeError:
        return {"error": {"exit": done.returncode, "stderr": done.stderr[-500:]}}


def wait_fleet_ready(stack: ComposeStack) -> None:
    give_up = time.monotonic() + READY_DEADLINE_S
    status: dict[str, Any] = {}
    while time.monotonic() < give_up:
        status = lorabus_json(stack, "status", timeout=30)
        ready = [m for m in status.get("members", []) if m.get("ready")]
        if status.get("leader") and len(ready) == len(FLEET_WORLD_SIZES):
            return
        time.sleep(1)
    raise AssertionError(
        f"the compose fleet was not ready within {READY_DEADLINE_S:.0f}s; "
        f"last status: {status}\n{stack.all_logs()}"
    )


async def update(stack: ComposeStack, step: int) -> dict[str, Any]:
    return await update_from_host(stack, "--path", f"/adapters/step_{step}", fleet=FLEET)


def served_by_each_worker(stack: ComposeStack) -> dict[str, list[str]]:
    served = {}
    for worker in FLEET_WORLD_SIZES:
        reply = httpx.get(f"{stack.sim_url}/workers/{worker}/v1/loras", timeout=10)
        reply.raise_for_status()
        served[worker] = sorted(reply.json()["loras"])
    return served


def test_the_image_runs_lorabus_as_a_non_root_user_with_oci_labels(built: ComposeStack) -> None:
    version = podman("run", "--rm", "--network=none", IMAGE, "lorabus", "--version")
    uid = podman("run", "--rm", "--network=none", IMAGE, "id", "-u")
    labels = json.loads(podman("image", "inspect", IMAGE))[0]["Labels"]

    assert version.strip() == f"lorabus, version {__version__}"
    assert uid.strip() != "0"
    assert labels["org.opencontainers.image.title"] == "lorabus"
    assert labels["org.opencontainers.image.version"] == __version__


def test_the_nats_fixtures_container_fallback_serves_a_fleet(
    built: ComposeStack, tmp_path: Path
) -> None:
    """conftest's fallback when nats-server is missing: NATS in the project's image,
    started by testcontainers; an embedded fleet commits an update through it."""
    if not os.environ.get("DOCKER_HOST") and not PODMAN_SOCKET.is_socket():
        pytest.skip(f"no Docker-compatible socket (neither DOCKER_HOST nor {PODMAN_SOCKET}): "
                    "scripts/setup-containers starts podman's")  # fmt: skip
    adapter = write_adapter(tmp_path / "adapters", 1)

    async def commit_through(url: str) -> str:
        async with EmbeddedStack([2, 1], fleet="tc", nats_url=url, heartbeat_s=0.2) as fleet:
            assert fleet.client is not None
            result = await fleet.client.update("policy", str(adapter), version=1, timeout_s=30)
            return result.status

    with nats_in_container(IMAGE) as url:
        assert url.startswith("nats://127.0.0.1:")
        assert asyncio.run(commit_through(url)) == "committed"


async def test_an_update_from_the_host_commits_on_every_simulated_worker(
    stack: ComposeStack,
) -> None:
    result = await update(stack, 1)

    assert result["status"] == "committed", result
    assert [
        (e["worker_id"], e["world_size"], e["rank_offset"]) for e in result["rank_map"]["entries"]
    ] == [("w000", 2, 1), ("w001", 4, 3), ("w002", 1, 7)]
    assert result["rank_map"]["world_size"] == 1 + sum(FLEET_WORLD_SIZES.values())
    served = served_by_each_worker(stack)
    assert all(result["adapter"] in adapters for adapters in served.values()), served


async def test_the_standby_commits_once_the_leaders_container_stops(stack: ComposeStack) -> None:
    leader = lorabus_json(stack, "status")["leader"]
    # compose.yaml names each coordinator (--holder) after its service.
    standby = {"coordinator-a": "coordinator-b", "coordinator-b": "coordinator-a"}[leader]

    await asyncio.to_thread(stack.stop, leader)
    result = await update(stack, 2)

    assert result["status"] == "committed", result
    assert lorabus_json(stack, "status")["leader"] == standby
    assert all(result["adapter"] in a for a in served_by_each_worker(stack).values())


async def test_an_update_commits_while_a_nats_node_stops_and_the_trail_loses_nothing(
    stack: ComposeStack, tmp_path: Path
) -> None:
    subjects = Subjects(fleet=FLEET)
    nodes = {f"nats-{i + 1}": f"nats://127.0.0.1:{p}" for i, p in enumerate(stack.nats_ports)}
    before = await stream_info(nodes.values(), subjects.audit_stream())
    assert before.config.num_replicas == 3
    # The node that leads the audit stream: losing it is what could lose records.
    victim = before.cluster.leader
    observer_url = next(url for name, url in nodes.items() if name != victim)

    nc = await connect(observer_url, name="test-containers-observer")
    try:
        commanded = asyncio.Event()
        subs = [await nc.subscribe(s, cb=set_on_message(commanded)) for s in subjects.audited()]
        running = asyncio.create_task(update(stack, 3))
        await asyncio.wait_for(commanded.wait(), 60)
        await asyncio.to_thread(stack.stop, victim)
        stopped_mid_run = not running.done()
        result = await asyncio.wait_for(running, 120)
        for sub in subs:
            await sub.unsubscribe()
    finally:
        await close(nc)

    assert result["status"] == "committed", result
    assert stopped_mid_run, "the update ended before the NATS node had stopped"
    assert all(result["adapter"] in a for a in served_by_each_worker(stack).values())

    survivors = [url for name, url in nodes.items() if name != victim]
    last_seq = (await stream_info(survivors, subjects.audit_stream())).state.last_seq
    trail = tmp_path / "trail.jsonl"
    lines = await wait_trail_reaches(stack, last_seq, trail)
    seqs = [json.loads(line)["seq"] for line in lines]
    assert seqs == list(range(1, last_seq + 1)), "the trail has a gap or a duplicate"
    assert any(result["update_id"] in line for line in lines)
    verified = await run_lorabus("audit", "verify", str(trail))
    assert verified.returncode == 0, verified


def test_down_leaves_no_container_network_or_volume(stack: ComposeStack) -> None:
    stack.down()

    assert stack.leftovers() == []


# compose.yaml with compose.auth.yaml: every service as its own identity of
# ``lorabus auth init``, over mutual TLS, and updates through the ``orchestrator``
# service of the ``tools`` profile, as the README says. Its own project, after
# the plain stack is down, so the two never share the machine's two cores.

AUTH_FILES = ("compose.yaml", "compose.auth.yaml")
#: What NATS (the server's log) and lorabus (a client's error callback) say when
#: a connection is refused a subject or its credentials.
VIOLATIONS = re.compile(
    r"permissions violation|authorization violation|publish violation|subscription violation",
    re.IGNORECASE,
)

#: A coordinator's second answer on an orchestrator's request inbox (see below).
IDENTITY_VARIABLES = ("LORABUS_IDENTITY", "LORABUS_NATS_", "LORABUS_TLS_", "LORABUS_INBOX_PREFIX")


@pytest.fixture(scope="module")
def auth_stack(built: ComposeStack) -> Iterator[ComposeStack]:
    """The credentialed stack, up, with every agent live and a coordinator leading."""
    stack = ComposeStack(
        built.image, sim_load_latency=LOAD_LATENCY_S, files=AUTH_FILES, profiles=("tools",)
    )
    try:
        stack.up()
        # The orchestrator's commands run in one container started now, not a
        # container each: with aardvark-dns before 1.11 (Debian 12's podman),
        # every container that joins or leaves the network stalls the others'
        # name lookups for up to 20 s (containers/aardvark-dns#389), and an
        # agent that looks up its engine then misses a phase deadline.
        stack.compose(
            "run", "--detach", "--name", tools_container(stack), "orchestrator", "sleep", "infinity"
        )
        wait_auth_fleet_ready(stack)
        yield stack
    finally:
        try:
            stack.down()
        finally:
            stack.remove_leftovers()


def tools_container(stack: ComposeStack) -> str:
    """The name of the stack's long-lived ``orchestrator`` container."""
    return f"{stack.project}_orchestrator_tools"


def orchestrate(stack: ComposeStack, *args: str, timeout: float = 120.0) -> dict[str, Any]:
    """``lorabus <args> --json`` in the stack's ``orchestrator`` container; its JSON
    answer (or the exit and stderr when it printed none)."""
    done = subprocess.run(
        ["podman", "exec", tools_container(stack), "lorabus", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    start = done.stdout.find("{")
    try:
        return dict(json.loads(done.stdout[start:])) if start >= 0 else {}
    except json.JSONDecodeError:
        pass
    return {
        "error": {
            "exit": done.returncode,
            "stdout": done.stdout[-800:],
            "stderr": done.stderr[-800:],
        }
    }


def wait_auth_fleet_ready(stack: ComposeStack) -> None:
    give_up = time.monotonic() + READY_DEADLINE_S
    status: dict[str, Any] = {}
    while time.monotonic() < give_up:
        status = orchestrate(stack, "status", timeout=60)
        ready = [m for m in status.get("members", []) if m.get("ready")]
        if (
            status.get("leader")
            and len(ready) == len(FLEET_WORLD_SIZES)
            and agents_resolve_the_engines(stack)
        ):
            return
        time.sleep(1)
    raise AssertionError(
        f"the credentialed compose fleet was not ready within {READY_DEADLINE_S:.0f}s; "
        f"last status: {status}\n{stack.all_logs()}"
    )


def agents_resolve_the_engines(stack: ComposeStack) -> bool:
    """Whether every agent's container looks up the engines' host at once. The
    credentialed stack's agents restart until the identities exist, and with
    aardvark-dns before 1.11 a container that just (re)started may wait many
    seconds for its lookups (containers/podman#13983): an update then would
    spend its pause deadline on DNS."""
    probe = "import socket, time; t = time.monotonic(); socket.getaddrinfo('sim', 8000); "
    probe += "print(time.monotonic() - t)"
    for worker in FLEET_WORLD_SIZES:
        done = subprocess.run(
            ["podman", "exec", stack.container(f"agent-{worker}"), "python3", "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0 or float(done.stdout.strip() or "inf") > 1.0:
            return False
    return True


def test_with_credentials_an_update_through_the_orchestrator_service_commits(
    auth_stack: ComposeStack,
) -> None:
    result = orchestrate(
        auth_stack, "update", "--adapter", "policy", "--path", "/adapters/step_1", "--timeout", "90"
    )

    assert result.get("status") == "committed", (
        f"{result}\n{auth_stack.all_logs()}\n--- engine calls\n{auth_stack.sim_requests()}"
    )
    assert [
        (e["worker_id"], e["world_size"], e["rank_offset"]) for e in result["rank_map"]["entries"]
    ] == [("w000", 2, 1), ("w001", 4, 3), ("w002", 1, 7)]
    assert result["rank_map"]["world_size"] == 1 + sum(FLEET_WORLD_SIZES.values())
    served = served_by_each_worker(auth_stack)
    assert all(result["adapter"] in adapters for adapters in served.values()), served


def test_with_credentials_no_service_was_refused_a_subject(auth_stack: ComposeStack) -> None:
    """Every role's permissions cover what it does: no NATS node and no lorabus
    service logged a violation during the start and the update above."""
    logs = auth_stack.full_logs()
    found = {
        service: [line for line in text.splitlines() if VIOLATIONS.search(line)]
        for service, text in logs.items()
    }

    assert set(logs) >= {"nats-1", "nats-2", "nats-3", "coordinator-a", "agent-w000", "tap"}
    lines = [f"{s}: {line}" for s, lines in found.items() for line in lines]
    assert lines == [], "refused subjects or credentials:\n" + "\n".join(lines)


def test_with_credentials_a_client_without_an_identity_is_refused(
    auth_stack: ComposeStack, tmp_path: Path
) -> None:
    """From the host, through a published port: no identity at all fails the TLS
    check of the server; the fleet's CA but no client certificate is refused by
    mutual TLS; a client certificate but no nkey is refused as unauthorized."""
    url = f"tls://127.0.0.1:{auth_stack.nats_ports[0]}"
    orchestrator = auth_stack.copy_out("nats-1", "/auth/orchestrator", tmp_path / "orchestrator")
    ca = auth_stack.copy_out("nats-1", "/auth/ca.pem", tmp_path / "ca.pem")
    # The host's environment without any identity lorabus would pick up.
    bare = {k: v for k, v in auth_stack.env.items() if not k.startswith(IDENTITY_VARIABLES)}

    def status(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [LORABUS, "status", "--nats", url],
            env={**bare, "LORABUS_FLEET": FLEET, **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    nothing = status()
    no_certificate = status(LORABUS_TLS_CA=str(ca))
    no_nkey = status(
        LORABUS_TLS_CA=str(ca),
        LORABUS_TLS_CERT=str(orchestrator / "client-cert.pem"),
        LORABUS_TLS_KEY=str(orchestrator / "client-key.pem"),
    )

    assert nothing.returncode != 0
    assert "TLS: cannot verify the certificate" in nothing.stderr, nothing.stderr
    assert no_certificate.returncode != 0
    assert "TLS: NATS at" in no_certificate.stderr, no_certificate.stderr
    assert no_nkey.returncode != 0
    assert "authorization violation" in no_nkey.stderr.lower(), no_nkey.stderr


def test_with_credentials_down_leaves_no_container_network_or_volume(
    auth_stack: ComposeStack,
) -> None:
    # podman-compose's ``down`` leaves what ``run --detach`` started: the
    # orchestrator's container goes first, as a user's own ``run`` would end.
    podman("rm", "--force", "--time", "2", tools_container(auth_stack))
    auth_stack.down()

    assert auth_stack.leftovers() == []


# compose.yaml with compose.node.yaml: one node-agent service drives the three
# simulated workers on one connection, the per-worker agents left out. Its own
# project, after the others are down.

NODE_FILES = ("compose.yaml", "compose.node.yaml")


@pytest.fixture(scope="module")
def node_stack(built: ComposeStack) -> Iterator[ComposeStack]:
    """The stack with a node agent, up, with every worker live and a leader."""
    stack = ComposeStack(built.image, sim_load_latency=LOAD_LATENCY_S, files=NODE_FILES)
    try:
        stack.up()
        wait_fleet_ready(stack)
        yield stack
    finally:
        try:
            stack.down()
        finally:
            stack.remove_leftovers()


async def test_one_node_agent_serves_every_worker_and_its_stop_takes_them_all(
    node_stack: ComposeStack,
) -> None:
    services = node_stack.containers()
    assert "node-a" in services and not any(s.startswith("agent-") for s in services), services

    result = await update(node_stack, 1)

    assert result["status"] == "committed", result
    assert [
        (e["worker_id"], e["world_size"], e["rank_offset"]) for e in result["rank_map"]["entries"]
    ] == [("w000", 2, 1), ("w001", 4, 3), ("w002", 1, 7)]
    served = served_by_each_worker(node_stack)
    assert all(result["adapter"] in adapters for adapters in served.values()), served

    node_stack.stop("node-a")
    give_up = time.monotonic() + READY_DEADLINE_S
    members: list[Any] = ["not asked yet"]
    while members and time.monotonic() < give_up:
        members = lorabus_json(node_stack, "status", timeout=30).get("members", ["no answer"])
        await asyncio.sleep(1)
    assert members == [], f"the node's workers did not leave together: {members}"


def test_with_a_node_agent_down_leaves_no_container_network_or_volume(
    node_stack: ComposeStack,
) -> None:
    node_stack.down()

    assert node_stack.leftovers() == []


def set_on_message(event: asyncio.Event) -> Callable[[Msg], Awaitable[None]]:
    async def on_message(_msg: Msg) -> None:
        event.set()

    return on_message


async def stream_info(urls: Iterable[str], stream: str) -> Any:
    nc = await connect(",".join(urls), name="test-containers-streams")
    try:
        return await nc.jetstream().stream_info(stream)
    finally:
        await close(nc)


async def wait_trail_reaches(stack: ComposeStack, last_seq: int, dest: Path) -> list[str]:
    """The lines of the tap's file (copied to ``dest``) once it holds the record at
    ``last_seq``; fail after a deadline."""
    give_up = time.monotonic() + 60
    seen = 0
    while time.monotonic() < give_up:
        lines = (await asyncio.to_thread(stack.read_trail, dest)).splitlines()
        seen = json.loads(lines[-1])["seq"] if lines else 0
        if seen >= last_seq:
            return lines
        await asyncio.sleep(0.5)
    tap_log = stack.logs("tap")
    raise AssertionError(f"the tap's trail stopped at seq {seen} of {last_seq}\n{tap_log}")
