"""Cluster mode's node partition, on a real 3-node nats-server cluster: the
cut-off node's clients stay connected to it and reach nobody else, every
route goes through the proxies that the cut stops (none dialled around
them, also after nodes restarted), a new connection falls over to a node still joined, and what was
held arrives, in order, once the node is joined again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from lorabus.bus.connect import close, connect
from lorabus.errors import NatsServerMissing
from lorabus.testbed.chaos.config import FleetSettings
from lorabus.testbed.chaos.fleet import ChaosFleet
from lorabus.testbed.chaos.timeline import AGENT_CUT_OFF, NATS_NODE_PARTITIONED, Timeline
from lorabus.testbed.natsserver import find_nats_server

DEADLINE_S = 20.0
HELD_S = 0.5
"""How long a message that must not arrive is waited for."""


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[ChaosFleet]:
    try:
        find_nats_server()
    except NatsServerMissing as missing:
        pytest.skip(f"cluster mode starts its own nats-servers: {missing}")
    settings = FleetSettings(world_sizes=(1, 1), nats_nodes=3)
    async with ChaosFleet(settings, tmp_path, Timeline(), out=lambda _: None) as fleet:
        yield fleet


class _Inbox:
    def __init__(self) -> None:
        self.got: list[bytes] = []
        self._changed = asyncio.Event()

    async def take(self, msg: Msg) -> None:
        self.got.append(msg.data)
        self._changed.set()

    async def wait_for(self, count: int, timeout_s: float = DEADLINE_S) -> list[bytes]:
        async with asyncio.timeout(timeout_s):
            while len(self.got) < count:
                self._changed.clear()
                await self._changed.wait()
        return self.got


async def _joined(sender: NatsClient, inbox: _Inbox, subject: str) -> None:
    """Until the cluster carries ``sender``'s messages to the observer's node."""
    async with asyncio.timeout(DEADLINE_S):
        while not inbox.got:
            await sender.publish(subject, b"ping")
            await asyncio.sleep(0.1)
    inbox.got.clear()


async def test_a_node_cut_off_reaches_nobody_until_joined_and_new_connections_go_elsewhere(
    fleet: ChaosFleet,
) -> None:
    # Links are homed in turn: the first on node 0, the agent's on node 1.
    await fleet._link("coordinator-c1")
    link = await fleet._link("agent-w000")
    cut_node = fleet.faultable_node()
    assert cut_node == 1, "node 0 is the observer's and never faulted"
    observer = await connect(fleet.nats_url, name="test-observer")
    agent = await connect(link.url, name="test-agent")
    later: NatsClient | None = None
    try:
        inbox = _Inbox()
        await observer.subscribe("t.>", cb=inbox.take)
        await observer.flush()
        # Restarted nodes gossip routes again: still none around the proxies.
        for node in (1, 2, 1, 2):
            await fleet.stop_nats(node)
            await fleet.start_nats(node)
        await close(agent)  # its link fell over to another node meanwhile
        agent = await connect(link.url, name="test-agent")
        await _joined(agent, inbox, "t.warm")
        assert link.reaches(fleet.nodes[1].port)
        assert agent.discovered_servers == [], "no node's own address to reconnect to"

        fleet.cut_off_node(cut_node)
        await agent.publish("t.held", b"1")
        await agent.publish("t.held", b"2")
        await agent.flush()  # its own node answers: the client sees nothing wrong
        with pytest.raises(TimeoutError):
            await inbox.wait_for(1, timeout_s=HELD_S)

        later = await connect(link.url, name="test-agent-reconnected")
        await later.publish("t.elsewhere", b"3")
        assert await inbox.wait_for(1) == [b"3"], "a new connection avoids the cut-off node"

        windows = {(w.kind, w.worker_id) for w in fleet.timeline.windows if w.end is None}
        assert windows == {(NATS_NODE_PARTITIONED, "n1"), (AGENT_CUT_OFF, "w000")}

        fleet.reconnect_node(cut_node)
        assert await inbox.wait_for(3) == [b"3", b"1", b"2"], "held, then delivered in order"
        assert all(w.end is not None for w in fleet.timeline.windows)
    finally:
        for nc in (observer, agent, later):
            if nc is not None:
                await close(nc)
