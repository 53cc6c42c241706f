"""A leader whose request subscriptions the server lost steps aside, and the
next term serves requests again (coordinator/service.py, ``_check_routed``).

The real coordinator and agents on the in-memory bus. The server-side loss
is made by removing the leader's request subscriptions from the server
alone: the coordinator process still believes it holds them, as a leader
did once in a chaos run after two server restarts. Its probe then hears
"no responders", and it steps aside; with no standby, it leads again after
two leases of silence, subscribed afresh.
"""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
from memory_fleet import InMemoryFleet

from lorabus.errors import NoCoordinator

pytestmark = pytest.mark.looptime


async def test_a_leader_the_server_routes_no_requests_to_steps_aside_and_serves_again() -> None:
    async with InMemoryFleet({"w0": 1, "w1": 1}, leader_lease_s=1.0) as fleet:
        client = fleet.client()
        first_epoch = (await client.status()).epoch
        request_subjects = {
            fleet.subjects.update_request(),
            fleet.subjects.status_request(),
            fleet.subjects.result_request(),
            fleet.subjects.reset_request(),
        }
        lost = [s for s in fleet.server._subs if s.subject in request_subjects]
        assert lost, "the leader serves the request subjects"
        for sub in lost:
            fleet.server._subs.remove(sub)  # the server forgets them; the leader does not know
        with pytest.raises(nats.errors.NoRespondersError):
            await fleet.server.connect("asker").request(fleet.subjects.status_request(), b"{}")

        async with asyncio.timeout(60):
            while True:
                try:
                    status = await client.status(timeout_s=1)
                    break
                except NoCoordinator:
                    await asyncio.sleep(0.5)
        assert status.epoch > first_epoch
        assert (await client.update("p", "/adapters/p/1", version=1)).committed


async def test_a_leader_that_is_routed_its_probes_stays() -> None:
    """Its own probes reach it, unanswered: nothing steps aside, nothing is
    audited, and its epoch stays."""
    async with InMemoryFleet({"w0": 1}, leader_lease_s=1.0) as fleet:
        client = fleet.client()
        first = await client.status()
        await asyncio.sleep(20.0)
        assert (await client.status()).epoch == first.epoch
        bad = [p for s, p in fleet.server.published if b"bad_message" in p]
        assert bad == []
