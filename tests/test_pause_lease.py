"""The agent's pause lease on a fake clock: a pause nobody renews ends on its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from lorabus.agents.lease import LeaseState, PauseLease

pytestmark = pytest.mark.looptime


class Expiries:
    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    async def __call__(self, update_id: str) -> None:
        self.seen.append((update_id, asyncio.get_running_loop().time()))


@pytest.fixture
async def watched() -> AsyncIterator[tuple[PauseLease, Expiries]]:
    lease, expiries = PauseLease(), Expiries()
    watching = asyncio.create_task(lease.watch(expiries))
    yield lease, expiries
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)


async def test_a_lease_nobody_renews_expires_at_its_end(
    watched: tuple[PauseLease, Expiries],
) -> None:
    lease, expiries = watched
    armed_at = asyncio.get_running_loop().time()
    lease.arm("u1", 30)
    await asyncio.sleep(29)
    assert expiries.seen == []
    await asyncio.sleep(2)
    assert expiries.seen == [("u1", pytest.approx(armed_at + 30))]
    assert lease.state is LeaseState.EXPIRED


async def test_renewals_push_the_end_out(watched: tuple[PauseLease, Expiries]) -> None:
    lease, expiries = watched
    lease.arm("u1", 10)
    for _ in range(5):
        await asyncio.sleep(8)
        lease.renew("u1", 10)
    assert expiries.seen == []
    await asyncio.sleep(11)
    assert [update_id for update_id, _ in expiries.seen] == ["u1"]


async def test_a_renewal_for_another_update_does_not_extend_the_lease(
    watched: tuple[PauseLease, Expiries],
) -> None:
    lease, expiries = watched
    lease.arm("u1", 10)
    await asyncio.sleep(8)
    lease.renew("u0", 10)
    await asyncio.sleep(3)
    assert [update_id for update_id, _ in expiries.seen] == ["u1"]


async def test_a_released_lease_never_expires(watched: tuple[PauseLease, Expiries]) -> None:
    lease, expiries = watched
    lease.arm("u1", 10)
    await asyncio.sleep(5)
    lease.release()
    await asyncio.sleep(3600)
    assert expiries.seen == []
    assert lease.remaining_s is None


async def test_a_new_pause_rearms_the_lease_for_its_own_update(
    watched: tuple[PauseLease, Expiries],
) -> None:
    lease, expiries = watched
    lease.arm("u1", 10)
    await asyncio.sleep(5)
    lease.arm("u2", 10)
    await asyncio.sleep(9)
    assert expiries.seen == []
    await asyncio.sleep(2)
    assert [update_id for update_id, _ in expiries.seen] == ["u2"]


async def test_a_new_pause_with_a_shorter_lease_ends_sooner(
    watched: tuple[PauseLease, Expiries],
) -> None:
    lease, expiries = watched
    armed_at = asyncio.get_running_loop().time()
    lease.arm("u1", 60)
    await asyncio.sleep(1)
    lease.arm("u2", 5)
    await asyncio.sleep(5.5)
    assert expiries.seen == [("u2", pytest.approx(armed_at + 6))]


async def test_a_lease_armed_again_after_it_ran_out_runs_out_again(
    watched: tuple[PauseLease, Expiries],
) -> None:
    lease, expiries = watched
    lease.arm("u1", 5)
    await asyncio.sleep(6)
    assert lease.state is LeaseState.EXPIRED
    lease.arm("u2", 5)
    assert lease.state is LeaseState.HELD
    await asyncio.sleep(4)
    assert [update_id for update_id, _ in expiries.seen] == ["u1"]
    await asyncio.sleep(2)
    assert [update_id for update_id, _ in expiries.seen] == ["u1", "u2"]


async def test_a_lease_released_then_armed_again_runs_from_the_new_pause(
    watched: tuple[PauseLease, Expiries],
) -> None:
    lease, expiries = watched
    lease.arm("u1", 10)
    await asyncio.sleep(2)
    lease.release()
    await asyncio.sleep(1)
    armed_at = asyncio.get_running_loop().time()
    lease.arm("u2", 10)  # u1's timer, due first, is kept and sets itself again
    await asyncio.sleep(9)
    assert expiries.seen == []
    await asyncio.sleep(2)
    assert expiries.seen == [("u2", pytest.approx(armed_at + 10))]


async def test_a_watch_cancelled_leaves_no_timer_behind() -> None:
    lease, expiries = PauseLease(), Expiries()
    watching = asyncio.create_task(lease.watch(expiries))
    await asyncio.sleep(0)
    lease.arm("u1", 10)
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)
    await asyncio.sleep(20)
    assert expiries.seen == []
    assert lease.state is LeaseState.HELD  # nobody ran it out: no timer fired


async def test_a_shared_pause_holds_until_every_update_of_its_round_let_it_go(
    watched: tuple[PauseLease, Expiries],
) -> None:
    lease, expiries = watched
    lease.arm("a", 10, epoch=1)
    lease.arm("b", 10, shared_with=["a", "c"], epoch=1)
    lease.arm("c", 10, shared_with=["a", "b"], epoch=1)
    assert lease.held_by_others("a", 1) == ["b", "c"]
    lease.release("a")
    lease.release("b")
    assert lease.state is LeaseState.HELD and lease.held_by_others("c", 1) == []
    lease.release("c")
    assert lease.state is LeaseState.RELEASED
    await asyncio.sleep(3600)
    assert expiries.seen == []


async def test_one_hold_of_a_round_that_runs_out_leaves_the_others_holding(
    watched: tuple[PauseLease, Expiries],
) -> None:
    lease, expiries = watched
    lease.arm("a", 10)
    lease.arm("b", 10, shared_with=["a"])
    for _ in range(3):
        await asyncio.sleep(8)
        lease.renew("b", 10)
    assert expiries.seen == [] and lease.held_by_others("x") == ["b"]
    await asyncio.sleep(11)
    assert [update_id for update_id, _ in expiries.seen] == ["b"]


async def test_a_pause_not_shared_drops_the_holds_before_it(
    watched: tuple[PauseLease, Expiries],
) -> None:
    lease, _ = watched
    lease.arm("a", 10)
    lease.arm("b", 10, shared_with=["a"])
    lease.arm("c", 10)  # its own round: a and b's resumes were lost
    assert lease.held_by_others("c") == []


async def test_a_later_terms_resume_does_not_wait_for_an_earlier_terms_holds(
    watched: tuple[PauseLease, Expiries],
) -> None:
    lease, _ = watched
    lease.arm("a", 10, epoch=1)
    lease.arm("b", 10, shared_with=["a"], epoch=1)
    assert lease.held_by_others("a", 1) == ["b"]
    assert lease.held_by_others("unknown-2", 2) == [], "a new leader resumes the engine"
