"""A cluster only its own nodes can join.

A route is a server-to-server link: a server that joins as a route sees and
sends every message of every account, whatever the client permissions,
nkeys and client TLS say. ``lorabus auth init --cluster-node`` writes route
credentials and route TLS with the fleet's CA; two nodes given that
configuration form one cluster, and a server started without them is
refused and hears nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from nats.aio.msg import Msg

from lorabus.bus.connect import Bus, close, connect
from lorabus.bus.options import BusOptions
from lorabus.schemas import Subjects
from lorabus.security.auth_init import write_fleet_auth
from lorabus.security.roles import Role
from lorabus.testbed.natsserver import NatsServer, free_port

DEADLINE_S = 20.0


async def _wait_for(condition: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(DEADLINE_S):
        # A log file has no signal to wait on: polled, under the deadline.
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
    assert condition(), what


async def test_only_nodes_with_the_route_credentials_join_the_cluster(
    tmp_path: Path, fleet_name: str
) -> None:
    s = Subjects(fleet=fleet_name)
    port_a, port_b, port_stranger = free_port(), free_port(), free_port()
    auth = write_fleet_auth(
        tmp_path / "auth",
        s,
        ["w000"],
        tls=True,
        cluster_nodes=[f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"],
    )
    conf = auth.server_conf.read_text()
    assert "nats-route://route:" in conf and "verify: true" in conf

    def bus(server: NatsServer, role: Role, worker: str | None = None) -> Bus:
        options = BusOptions.of_identity(auth.identity(role, worker).folder)
        return Bus(server.url.replace("nats://", "tls://"), options)

    def listen_on(port: int) -> list[str]:
        return ["--cluster", f"nats://127.0.0.1:{port}"]

    async with (
        NatsServer(include=auth.server_conf, options=listen_on(port_a)) as node_a,
        NatsServer(include=auth.server_conf, options=listen_on(port_b)) as node_b,
        NatsServer(cluster_port=port_stranger, routes=[port_a, port_b]) as stranger,
    ):
        coordinator = await bus(node_a, Role.COORDINATOR).connect("test-coordinator")
        agent = await bus(node_b, Role.AGENT, "w000").connect("test-agent")
        # No credentials at all on the stranger's node: a route would carry
        # this client's messages into the fleet's accounts and back.
        anonymous = await connect(stranger.url, name="test-stranger")
        heard_by_coordinator: list[Msg] = []
        heard_by_stranger: list[Msg] = []

        async def coordinator_hears(msg: Msg) -> None:
            heard_by_coordinator.append(msg)

        async def stranger_hears(msg: Msg) -> None:
            heard_by_stranger.append(msg)

        try:
            await coordinator.subscribe(s.heartbeat_any(), cb=coordinator_hears)
            await anonymous.subscribe(">", cb=stranger_hears)
            await coordinator.flush()
            await anonymous.flush()

            # The stranger dials both nodes; each refuses it at the TLS handshake.
            for node in (node_a, node_b):
                await _wait_for(
                    lambda node=node: "TLS route handshake error" in node.log_path.read_text(),
                    f"{node.name} refused no route",
                )

            # The fleet's nodes form one cluster: a heartbeat on b reaches a.
            async with asyncio.timeout(DEADLINE_S):
                while not heard_by_coordinator:
                    await agent.publish(s.heartbeat("w000"), b"from-node-b")
                    await agent.flush()
                    await asyncio.sleep(0.1)  # until the route is up, under the deadline

            # What the stranger publishes never reaches the fleet.
            await anonymous.publish(s.heartbeat("w000"), b"from-the-stranger")
            await anonymous.flush()
            await agent.publish(s.heartbeat("w000"), b"marker")
            await agent.flush()
            await _wait_for(
                lambda: any(m.data == b"marker" for m in heard_by_coordinator),
                "the marker reached the coordinator",
            )
        finally:
            for nc in (coordinator, agent, anonymous):
                await close(nc)

    assert all(m.data != b"from-the-stranger" for m in heard_by_coordinator)
    # ... and nothing of the fleet's reached the stranger (its own message aside).
    assert [m.data for m in heard_by_stranger] == [b"from-the-stranger"]
