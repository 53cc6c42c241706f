"""Agents converge to the committed adapter before they count as ready: what
needs real adapter directories (a deleted or rewritten one) or a hand-driven
coordinator. The rest runs in memory (test_reconciliation_in_memory.py)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

from hand_coordinator import EPOCH, HandCoordinator

from lorabus.adapters.digest import adapter_digest
from lorabus.schemas import PauseCommand, encode
from lorabus.simfleet import SimWorker
from lorabus.testbed.stack import EmbeddedStack
from lorabus.testbed.trainer import write_adapter

DEADLINE_S = 15.0


async def _unready_w001(stack: EmbeddedStack) -> SimWorker:
    """Make w001's engine lose the committed adapter for good, and wait until
    the coordinator shows w001 as not ready."""
    assert stack.client is not None and stack.sim is not None
    broken = stack.sim.workers["w001"]
    broken.remove_adapter("policy-v1")
    broken.set_faults(fail_next_loads=1000)  # it cannot reconcile

    async def not_ready() -> None:
        while True:
            status = await stack.client.status()  # type: ignore[union-attr]
            if any(m.worker_id == "w001" and not m.ready for m in status.members):
                return
            await asyncio.sleep(0.05)

    await asyncio.wait_for(not_ready(), DEADLINE_S)
    return broken


async def test_a_member_that_cannot_reload_the_committed_adapter_is_named_at_once(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    """Its directory was deleted, then its engine restarted: the agent cannot
    converge, says why in its heartbeat, and a --quorum all update fails at
    once naming it, instead of waiting out the quorum timeout."""
    async with make_stack([1, 1], quorum_timeout_s=120) as stack:
        assert stack.client is not None and stack.sim is not None
        committed_dir = make_adapter(1)
        assert (await stack.client.update("policy", committed_dir, version=1)).committed
        shutil.rmtree(committed_dir)
        stack.sim.workers["w001"].remove_adapter("policy-v1")  # as an engine restart would

        async with asyncio.timeout(60):
            while not (status := await stack.client.status()).members[1].unready_reason:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
            # Well inside the 120 s quorum timeout: the test fails if it waits that out.
            result = await stack.client.update("policy", make_adapter(2), version=2)

    stuck = status.members[1]
    assert (stuck.worker_id, stuck.ready) == ("w001", False)
    assert "policy-v1" in stuck.unready_reason and "failed 3 times" in stuck.unready_reason
    assert result.error is not None and result.error.code == "quorum_timeout"
    assert "w001" in result.error.message
    assert "not ready" in result.error.message and "failed 3 times" in result.error.message


async def test_a_member_does_not_reload_a_committed_directory_that_now_holds_other_bytes(
    tmp_path: Path,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    """The committed directory was rewritten in place after the commit (a
    trainer reusing its output directory, a half-finished sync); then w001's
    engine restarted. Reloading the path would serve other weights under the
    committed name: the agent refuses, and says why."""
    async with make_stack([1, 1], quorum_timeout_s=120) as stack:
        assert stack.client is not None and stack.sim is not None
        committed_dir = make_adapter(1)
        committed = await stack.client.update("policy", committed_dir, version=1)
        assert committed.committed, committed.error
        other_bytes = write_adapter(tmp_path / "retrained", 1, seed=7)
        shutil.copytree(other_bytes, committed_dir, dirs_exist_ok=True)
        rewritten = adapter_digest(committed_dir)
        stack.sim.workers["w001"].remove_adapter("policy-v1")  # as an engine restart would

        async with asyncio.timeout(60):
            while not (status := await stack.client.status()).members[1].unready_reason:  # noqa: ASYNC110
                await asyncio.sleep(0.2)

    assert committed.digest.startswith("sha256:") and rewritten != committed.digest
    stuck = status.members[1]
    assert (stuck.worker_id, stuck.ready) == ("w001", False)
    assert f"sees {rewritten}" in stuck.unready_reason, stuck.unready_reason
    assert committed.digest in stuck.unready_reason
    assert "policy-v1" not in stack.sim.workers["w001"].adapters
    assert "policy-v1" in stack.sim.workers["w000"].adapters


async def test_an_agent_takes_a_broadcast_pause_only_once_named_and_while_ready(
    hand: HandCoordinator,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    """A broadcast pause is for the members the coordinator counts: an agent
    takes one only after a pause of that term named it, and not while it
    converges to the committed state (a pause by name reaches it then)."""

    def named(update_id: str, *workers: str) -> PauseCommand:
        return PauseCommand(update_id=update_id, targets=list(workers), budget_s=5, epoch=EPOCH)

    def fleet_pause(update_id: str) -> PauseCommand:
        return PauseCommand(update_id=update_id, cohort=True, budget_s=5, epoch=EPOCH)

    async def acks_until(*awaited: tuple[str, str]) -> list[tuple[str, str]]:
        seen: list[tuple[str, str]] = []
        while not set(awaited) <= set(seen):
            ack = await hand.next_ack()
            seen.append((ack.update_id, ack.worker_id))
        return seen

    # A long leader lease: deposed by the hand, the stack's coordinator must
    # not take the fleet back at a higher epoch (fencing the hand) meanwhile.
    async with make_stack([1, 1], leader_lease_s=120) as stack:
        assert stack.client is not None and stack.sim is not None
        assert stack.coordinator is not None and stack.coordinator.epoch != EPOCH
        assert (await stack.client.update("policy", make_adapter(1), version=1)).committed
        await _unready_w001(stack)
        # Both were named by the stack's coordinator, not in this (the hand's) term.
        await hand.send(fleet_pause("u-early"))
        await hand.nc.publish(hand.subjects.cmd(), encode(named("u-named", "w000", "w001")))
        before_named = await acks_until(("u-named", "w000"), ("u-named", "w001"))
        await hand.send(fleet_pause("u-fleet"))
        marker = named("u-marker", "w001")
        await hand.nc.publish(hand.subjects.cmd_worker("w001"), encode(marker))
        # Each agent acks in order; the two agents' acks may interleave.
        after = await acks_until(("u-fleet", "w000"), ("u-marker", "w001"))

    assert not any(update == "u-early" for update, _ in before_named), before_named
    assert ("u-fleet", "w001") not in after, after
