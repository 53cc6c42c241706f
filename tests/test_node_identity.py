"""A node speaks for its own workers and no other.

``lorabus auth init --node`` gives a node agent one identity: a real
nats-server started from the written configuration lets it publish its
acks and beats only on its node's subjects and hear only its workers'
commands. What it may publish there, the coordinator takes only for the
node's own workers (the nodes file): a node that claims another node's
worker, or a lone agent's, changes nothing at the coordinator.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from nats.aio.msg import Msg
from secured import watched

from lorabus.bus.connect import Bus, close, connect, flushed
from lorabus.bus.options import BusOptions
from lorabus.coordinator.bus import CoordinatorBus
from lorabus.coordinator.membership import Membership
from lorabus.schemas import Heartbeat, NodeBeats, Subjects, encode
from lorabus.schemas.nodes import NODES_ENV, NodeRoster, decode_nodes
from lorabus.security.auth_init import NODES_FILE, write_fleet_auth
from lorabus.security.roles import Role
from lorabus.testbed.natsserver import NatsServer

FLEET = "nodes"
NODES = {"n1": ["w000", "w001"], "n2": ["w003"]}
LONE = "w002"
DEADLINE_S = 10.0


def beat(worker_id: str) -> Heartbeat:
    # A long period: a loaded machine must not age a beat out before the check.
    return Heartbeat(
        worker_id=worker_id, world_size=1, engine="dynamo", adapters=[], paused=False, interval_s=30
    )


async def test_a_node_identity_publishes_on_its_subjects_and_hears_its_workers_alone(
    tmp_path: Path,
) -> None:
    s = Subjects(fleet=FLEET)
    auth = write_fleet_auth(tmp_path / "auth", s, [LONE], nodes=NODES)
    # Every identity that reads acks or beats (status, audit verify) has the file.
    for reader in (Role.COORDINATOR, Role.ORCHESTRATOR, Role.AUDITOR, Role.OPERATOR):
        folder = auth.identity(reader).folder
        assert decode_nodes((folder / NODES_FILE).read_bytes()) == NODES
        assert f"{NODES_ENV}={folder / NODES_FILE}" in (folder / "lorabus.env").read_text()
    async with NatsServer(include=auth.server_conf) as server:
        coordinator = await connect(
            server.url,
            name="test-coordinator",
            options=BusOptions.of_identity(auth.identity(Role.COORDINATOR).folder),
        )
        heard: asyncio.Queue[Msg] = asyncio.Queue()

        async def on_message(msg: Msg) -> None:
            heard.put_nowait(msg)

        await coordinator.subscribe(s.ack_any(), cb=on_message)
        await coordinator.subscribe(s.heartbeat_any(), cb=on_message)
        await coordinator.flush()
        node = Bus(server.url, BusOptions.of_identity(auth.identity(Role.NODE, "n1").folder))
        try:
            async with watched(node) as n1:
                # Its own subjects cross into the fleet's account.
                batch = encode(NodeBeats(node="n1", beats=[beat("w000"), beat("w001")]))
                await n1.nc.publish(s.heartbeat("n1"), batch)
                async with asyncio.timeout(DEADLINE_S):
                    got = await heard.get()
                assert (got.subject, got.data) == (s.heartbeat("n1"), batch)
                for worker in NODES["n1"]:
                    await n1.nc.subscribe(s.cmd_worker(worker))
                await n1.nc.subscribe(s.cmd())
                # Nothing in a lone agent's, another node's or a worker's own
                # name, no command, no request, no write of state or store.
                state, store = s.state_bucket(), s.adapter_store()
                forbidden = (
                    s.ack("w000"),
                    s.heartbeat("w001"),
                    s.ack(LONE),
                    s.heartbeat("n2"),
                    s.agent_event(LONE, "reconciled"),
                    s.coordinator_event("update_finished"),
                    s.cmd(),
                    s.cmd_worker("w000"),
                    s.update_request(),
                    s.reset_request(),
                    f"$KV.{state}.committed",
                    f"$O.{store}.C.forged",
                    f"$JS.API.STREAM.PURGE.OBJ_{store}",
                    f"$JS.API.STREAM.DELETE.{s.audit_stream()}",
                )
                for subject in forbidden:
                    await n1.nc.publish(subject, b"{}")
                    await n1.wait_refusal("publish", subject)
                unheard = (s.cmd_worker(LONE), s.cmd_worker("w003"), s.ack_any())
                for subject in unheard:
                    await n1.nc.subscribe(subject)
                    await n1.wait_refusal("subscription", subject)
                await n1.nc.flush()
                assert len(n1.refusals()) == len(forbidden) + len(unheard), n1.refusals()
                assert heard.empty(), "a refused publish reached the coordinator"
        finally:
            await close(coordinator)


def test_a_signing_coordinator_without_a_nodes_file_takes_no_nodes_message() -> None:
    """A fleet with identities lets each lone agent publish on the ack subject
    of its own id: without a nodes file, a node message there could speak
    for every worker, so a coordinator that signs takes none."""
    closed, open_ = NodeRoster.load("", secured=True), NodeRoster.load("")
    assert closed.refusal("w005", "w001") is not None
    assert open_.refusal("w005", "w001") is None


async def test_the_coordinator_takes_a_nodes_beats_only_for_its_own_workers() -> None:
    s = Subjects(fleet="roster")
    membership = Membership()
    async with NatsServer() as server:
        nc = await connect(server.url, name="test-coordinator-bus")
        sender = await connect(server.url, name="test-forger")
        bus = CoordinatorBus(nc, s, membership, nodes=NodeRoster(NODES))
        subs = await bus.follow()
        await flushed(nc)  # the subscriptions are at the server before anything is sent
        try:
            # n1 for its own w000, and for n2's w003 and the lone w002: only w000 counts.
            forged = NodeBeats(node="n1", beats=[beat("w000"), beat("w003"), beat(LONE)])
            await sender.publish(s.heartbeat("n1"), encode(forged))
            # A message claiming another node's subject, a lone beat on a node's
            # subject, and a node the file does not list: none counts.
            claims_n1 = NodeBeats(node="n1", beats=[beat("w000")])
            await sender.publish(s.heartbeat("n2"), encode(claims_n1))
            await sender.publish(s.heartbeat("n1"), encode(beat("n1")))
            unlisted = NodeBeats(node="n9", beats=[beat("w009")])
            await sender.publish(s.heartbeat("n9"), encode(unlisted))
            # Then n2 for its own worker: once it counts, everything before it was read.
            own = NodeBeats(node="n2", beats=[beat("w003")])
            await sender.publish(s.heartbeat("n2"), encode(own))
            await sender.flush()
            try:
                async with asyncio.timeout(DEADLINE_S):
                    while True:
                        if "w003" in membership.live() and bus.dropped >= 4:
                            break
                        await asyncio.sleep(0.02)
            except TimeoutError:
                raise AssertionError(
                    f"live {sorted(membership.live())}, dropped {bus.dropped}"
                ) from None
            assert set(membership.live()) == {"w000", "w003"}
            # One drop per message refused (two of n1's entries in one).
            assert bus.dropped == 4
        finally:
            for sub in subs:
                await sub.unsubscribe()
            await close(sender)
            await close(nc)
