"""The status answers per adapter: every committed adapter with its served
name, version, digest, when it was committed, the versions kept beside it
and which live members hold it, in ``client.status()``, ``lorabus status``
and its ``--json``; and a successor lists the adapters committed before it
took over.

Against a real nats-server, the simulated HTTP engines, a real agent per
worker and the real coordinator; the CLI runs as a process of its own.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable

from processes import run_lorabus

from lorabus.client import UpdateClient
from lorabus.schemas import FleetStatus
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 15.0
WORKERS = ["w000", "w001"]


async def _status_once_held(client: UpdateClient, adapters: list[str]) -> FleetStatus:
    """The status, once every live member's heartbeat lists each of ``adapters``'
    committed version (heartbeats come every 0.2 s)."""
    async with asyncio.timeout(DEADLINE_S):
        while True:
            status = await client.status()
            listed = {a.adapter: a for a in status.adapters}
            if all(a in listed and listed[a].holders == WORKERS for a in adapters):
                return status
            await asyncio.sleep(0.1)


async def test_the_status_lists_both_adapters_with_holders_and_when_committed(
    make_stack: Callable[..., EmbeddedStack], make_adapter: Callable[[int], str]
) -> None:
    before = time.time()
    async with make_stack([1, 1], keep=2) as stack:
        assert stack.client is not None
        client = stack.client
        results = [
            await client.update("policy", make_adapter(1), version=1),
            await client.update("policy", make_adapter(2), version=2),
            await client.update("critic", make_adapter(3), version=7, keep=1),
        ]
        assert all(r.committed for r in results), [r.error for r in results]
        status = await _status_once_held(client, ["policy", "critic"])
        bus = ["--nats", stack.nats_url, "--fleet", stack.fleet_name]
        as_text = await run_lorabus("status", *bus)
        as_json = await run_lorabus("status", *bus, "--json")
    after = time.time()

    critic, policy = status.adapters  # by name
    assert (policy.adapter, policy.served_name, policy.version) == ("policy", "policy-v2", 2)
    assert (policy.path, policy.digest) == (results[1].path, results[1].digest)
    assert policy.kept == ["policy-v1"] and policy.holders == WORKERS
    assert (critic.adapter, critic.served_name, critic.version) == ("critic", "critic-v7", 7)
    assert critic.kept == [] and critic.holders == WORKERS
    assert before < policy.committed_at < critic.committed_at < after
    # The latest commit, of any adapter, as before.
    assert (status.committed_adapter, status.committed_version) == ("critic-v7", 7)

    assert as_text.returncode == 0, as_text
    lines = as_text.stdout.splitlines()
    assert "adapters (2):" in lines
    [policy_line] = [line for line in lines if line.startswith("  policy: ")]
    assert policy_line.startswith(f"  policy: policy-v2 (version 2, {policy.digest[:19]}), ")
    assert re.search(r", committed \d+[smhd] ago; ", policy_line), policy_line
    assert policy_line.endswith("held by all 2 live members; kept beside it: policy-v1")
    assert any(line.startswith("  critic: critic-v7 (version 7, ") for line in lines)

    assert as_json.returncode == 0, as_json
    listed = json.loads(as_json.stdout)["adapters"]
    assert [(a["adapter"], a["served_name"], a["holders"], a["kept"]) for a in listed] == [
        ("critic", "critic-v7", WORKERS, []),
        ("policy", "policy-v2", WORKERS, ["policy-v1"]),
    ]
    assert listed[1]["committed_at"] == policy.committed_at


async def test_a_successor_lists_the_adapters_committed_before_it_took_over(
    make_stack: Callable[..., EmbeddedStack], make_adapter: Callable[[int], str]
) -> None:
    async with make_stack([1, 1], leader_lease_s=1.0, holder="first") as first:
        assert first.client is not None
        committed = [
            await first.client.update("policy", make_adapter(1), version=1),
            await first.client.update("policy", make_adapter(2), version=2),
            await first.client.update("critic", make_adapter(3), version=1),
        ]
        assert all(r.committed for r in committed), [r.error for r in committed]
        before = await first.client.status()
    # A new coordinator, once the first one's lease has run out: a new term.
    async with make_stack([1, 1], leader_lease_s=1.0, holder="second") as second:
        assert second.client is not None
        # The agents converge on what is committed: at least the latest commit.
        after = await _status_once_held(second.client, ["critic"])

    assert (after.leader, before.leader) == ("second", "first")
    assert after.epoch > before.epoch
    assert [(a.adapter, a.served_name, a.version, a.kept) for a in after.adapters] == [
        ("critic", "critic-v1", 1, []),
        ("policy", "policy-v2", 2, ["policy-v1"]),
    ]
    assert [a.committed_at for a in after.adapters] == [a.committed_at for a in before.adapters]
    assert all(set(a.holders) <= {"w000", "w001"} for a in after.adapters)
