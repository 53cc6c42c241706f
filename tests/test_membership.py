"""Membership from heartbeats, on a fake clock: who is live, when a quorum is
reached, and that silent workers are forgotten."""

from __future__ import annotations

import asyncio
import math
import threading

import msgspec
import pytest

from lorabus.coordinator.membership import (
    FORGET_AFTER_BEATS,
    MISSED_BEATS,
    REFUSE_AGAIN_AFTER_BEATS,
    Membership,
)
from lorabus.errors import QuorumNotReached
from lorabus.schemas import Ack, Heartbeat, Phase

BEAT_S = 1.0


def _beat(worker_id: str, world_size: int = 1, *, ready: bool = True) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id,
        world_size=world_size,
        engine="dynamo",
        adapters=[],
        paused=False,
        interval_s=BEAT_S,
        ready=ready,
    )


async def _keep_beating(membership: Membership, *beats: Heartbeat) -> None:
    while True:
        for beat in beats:
            membership.observe(beat)
        await asyncio.sleep(BEAT_S)


@pytest.mark.looptime
async def test_a_member_is_live_for_three_of_its_beats_then_not() -> None:
    membership = Membership()
    membership.observe(_beat("w0"))
    await asyncio.sleep(MISSED_BEATS * BEAT_S - 0.01)
    assert membership.is_live("w0")
    await asyncio.sleep(0.02)
    assert not membership.is_live("w0")
    assert membership.live() == {}


def _ack(worker_id: str, *, paused: bool = True) -> Ack:
    return Ack(
        update_id="u1",
        phase=Phase.PAUSE,
        worker_id=worker_id,
        ok=True,
        world_size=1,
        adapters=["p-v1"],
        paused=paused,
    )


@pytest.mark.looptime
async def test_an_ack_keeps_a_member_live_and_carries_its_engine_state() -> None:
    membership = Membership()
    membership.observe(_beat("w0"))
    await asyncio.sleep(1.5 * BEAT_S)
    membership.observe_ack(_ack("w0"))
    await asyncio.sleep(MISSED_BEATS * BEAT_S - 0.01)

    assert membership.is_live("w0"), "the ack counted as a sign of life"
    status = membership.live()["w0"].heartbeat
    assert (status.paused, status.adapters) == (True, ["p-v1"])


@pytest.mark.looptime
async def test_an_ack_after_a_missed_beat_marks_a_rejoin_and_none_revives_the_gone() -> None:
    membership = Membership()
    membership.observe(_beat("w0"))
    membership.observe(_beat("w1"))
    await asyncio.sleep(2.7 * BEAT_S)
    generation = membership.generation
    membership.observe_ack(_ack("w0"))
    assert membership.generation > generation, "silent for more than a skipped beat"
    assert membership.live()["w0"].joined_at == membership.live()["w0"].seen_at
    await asyncio.sleep(0.5 * BEAT_S)
    membership.observe_ack(_ack("w1"))

    assert membership.is_live("w0")
    assert not membership.is_live("w1"), "an ack does not revive a member that is gone"


@pytest.mark.looptime
async def test_a_quorum_is_the_live_ready_world_sizes_summing_to_the_expected_size() -> None:
    membership = Membership()
    membership.observe(_beat("w0", 2))
    membership.observe(_beat("w1", 4, ready=False))

    waiting = asyncio.create_task(membership.wait_quorum(6, timeout_s=30))
    await asyncio.sleep(5)
    assert not waiting.done(), "a member that is not ready counted"
    membership.observe(_beat("w0", 2))
    membership.observe(_beat("w1", 4))
    assert await waiting == {"w0": 2, "w1": 4}


@pytest.mark.looptime
async def test_without_a_quorum_the_wait_ends_at_its_deadline_naming_who_is_live() -> None:
    membership = Membership()
    beating = asyncio.create_task(_keep_beating(membership, _beat("w0", 2)))
    started = asyncio.get_running_loop().time()
    with pytest.raises(QuorumNotReached, match=r"sum to 2, which is short of the expected 3"):
        await membership.wait_quorum(3, timeout_s=30)
    assert asyncio.get_running_loop().time() - started == pytest.approx(30, abs=0.2)
    beating.cancel()
    await asyncio.gather(beating, return_exceptions=True)


@pytest.mark.looptime
async def test_a_partial_quorum_is_taken_after_the_grace_when_the_rest_is_missing() -> None:
    membership = Membership()
    beating = asyncio.create_task(_keep_beating(membership, _beat("w0", 3), _beat("w1", 1)))
    started = asyncio.get_running_loop().time()
    members = await membership.wait_quorum(5, timeout_s=30, needed=4, grace_s=2)
    assert members == {"w0": 3, "w1": 1}
    assert asyncio.get_running_loop().time() - started >= 2
    beating.cancel()
    await asyncio.gather(beating, return_exceptions=True)


@pytest.mark.looptime
async def test_a_worker_silent_for_many_beats_is_forgotten() -> None:
    membership = Membership()
    membership.observe(_beat("gone"))
    beating = asyncio.create_task(_keep_beating(membership, _beat("w0")))
    await asyncio.sleep((FORGET_AFTER_BEATS - 1) * BEAT_S)
    assert membership.known() == ["gone", "w0"]
    await asyncio.sleep(3 * BEAT_S)
    assert membership.known() == ["w0"]
    beating.cancel()
    await asyncio.gather(beating, return_exceptions=True)


async def test_the_live_members_can_be_read_from_another_thread_while_workers_join() -> None:
    membership = Membership()
    failures: list[BaseException] = []
    stop = threading.Event()

    def read_like_the_metrics_thread() -> None:
        try:
            while not stop.is_set():
                membership.live()
        except BaseException as exc:
            failures.append(exc)

    reader = threading.Thread(target=read_like_the_metrics_thread)
    reader.start()
    try:
        for i in range(20_000):
            membership.observe(_beat(f"w{i}"))
            if i % 1000 == 0:
                await asyncio.sleep(0)
    finally:
        stop.set()
        reader.join(timeout=10)
    assert failures == []
    assert len(membership.live()) == 20_000


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _instance_beat(instance: str, world_size: int = 1) -> Heartbeat:
    return msgspec.structs.replace(_beat("w0", world_size), instance=instance)


def test_a_second_instance_is_refused_once_the_live_holder_beats_again() -> None:
    clock = _Clock()
    membership = Membership(clock)
    assert membership.observe(_instance_beat("first")) is None
    clock.now += 0.1
    assert membership.observe(_instance_beat("second", world_size=4)) is None, "pending"
    assert membership.live_world_sizes() == {"w0": 1}
    clock.now += 0.1
    conflict = membership.observe(_instance_beat("first"))
    assert conflict is not None
    assert (conflict.holder.instance, conflict.refused.instance) == ("first", "second")
    clock.now += 0.1
    assert membership.observe(_instance_beat("second", world_size=4)) is None, "reported once"
    assert membership.observe(_instance_beat("first")) is None
    assert membership.live_world_sizes() == {"w0": 1}
    assert [c.heartbeat.instance for c, _ in membership.conflicts()] == ["second"]


def test_a_refused_instance_that_keeps_beating_is_refused_again_every_few_beats() -> None:
    """A refusal can be lost, or never sent by a coordinator not yet leading:
    one is sent again while the newcomer beats, but not at every beat."""
    clock = _Clock()
    membership = Membership(clock)
    membership.observe(_instance_beat("first"))
    membership.observe(_instance_beat("second"))
    clock.now += BEAT_S
    first = membership.observe(_instance_beat("first"))
    assert first is not None and not first.again
    refused_at = clock.now
    again: list[float] = []
    for _ in range(3 * REFUSE_AGAIN_AFTER_BEATS):
        clock.now += BEAT_S
        for beat in (_instance_beat("first"), _instance_beat("second")):
            conflict = membership.observe(beat)
            if conflict is not None:
                assert conflict.again and conflict.refused.instance == "second"
                again.append(clock.now)
    assert again == [
        pytest.approx(refused_at + k * REFUSE_AGAIN_AFTER_BEATS * BEAT_S) for k in range(1, 4)
    ]
    assert membership.live_world_sizes() == {"w0": 1}


def test_a_restarted_agent_takes_the_place_of_a_holder_that_stopped_beating() -> None:
    clock = _Clock()
    membership = Membership(clock)
    membership.observe(_instance_beat("killed"))
    clock.now += 0.5
    assert membership.observe(_instance_beat("restarted", world_size=2)) is None
    assert membership.instance_of("w0") == "killed", "the holder keeps it while live"
    clock.now += MISSED_BEATS * BEAT_S
    assert membership.observe(_instance_beat("restarted", world_size=2)) is None
    assert membership.instance_of("w0") == "restarted"
    assert membership.live_world_sizes() == {"w0": 2}
    assert membership.conflicts() == []


def test_a_holder_that_missed_a_beat_gives_its_place_to_a_new_instance_at_once() -> None:
    """A restarted agent's first beat, once the holder is silent past a missed
    beat (an agent skips at most one), takes the place: not three beats on."""
    clock = _Clock()
    membership = Membership(clock)
    membership.observe(_instance_beat("killed"))
    clock.now += 2.6 * BEAT_S
    assert membership.observe(_instance_beat("restarted", world_size=2)) is None
    assert membership.instance_of("w0") == "restarted"
    assert membership.live_world_sizes() == {"w0": 2}


def test_a_phase_that_finds_the_holder_gone_gives_its_place_to_the_beating_successor() -> None:
    """The successor beat while the holder could still have been alive; the
    holder then expired between two of its beats. A phase waiting on the
    worker sends it the command again, to the successor, instead of giving
    the worker up; with no successor the worker is gone."""
    clock = _Clock()
    membership = Membership(clock)
    membership.observe(_instance_beat("killed"))
    membership.observe(_beat("w1"))
    clock.now += 1.5 * BEAT_S
    membership.observe(_instance_beat("restarted"))
    assert membership.instance_of("w0") == "killed"
    clock.now += 1.6 * BEAT_S  # the holder expired; the successor beat 1.6 beats ago

    gone, rejoined, _ = membership.triage(["w0", "w1"], {"w0": 0.0, "w1": 0.0})

    assert (gone, rejoined) == (["w1"], ["w0"])
    assert membership.instance_of("w0") == "restarted"


def test_a_member_rejoins_when_first_heard_after_a_missed_beat_or_as_a_new_instance() -> None:
    """What the coordinator re-sends on at once: a command sent before an
    agent (re)joined may never have reached it."""
    clock = _Clock()
    membership = Membership(clock)
    assert membership.joined_at("w0") is None
    membership.observe(_instance_beat("first"))
    joined = clock.now
    for _ in range(3):
        clock.now += BEAT_S
        membership.observe(_instance_beat("first"))
    assert membership.joined_at("w0") == joined, "regular beats keep the join time"
    clock.now += 2.8 * BEAT_S
    membership.observe(_instance_beat("first"))
    assert membership.joined_at("w0") == clock.now, "a missed beat: cut off, then back"
    clock.now += MISSED_BEATS * BEAT_S
    membership.observe(_instance_beat("restarted"))
    assert membership.joined_at("w0") == clock.now, "a new instance"
    sent = clock.now - 1.0
    expires = clock.now + MISSED_BEATS * BEAT_S
    assert membership.triage(["w0", "w9"], {"w0": sent}) == (["w9"], ["w0"], expires)
    assert membership.triage(["w0"], {"w0": clock.now})[:2] == ([], []), "sent after it joined"
    clock.now += MISSED_BEATS * BEAT_S
    assert membership.triage(["w0"], {}) == (["w0"], [], math.inf), "silent: gone"


def test_a_triage_holds_until_a_member_could_expire_or_the_membership_moves() -> None:
    """A phase skips looking at every waiting member while nothing it could
    see has changed: no beat can make a member expire sooner, and every join,
    rejoin, forgetting or change of beat interval moves the generation."""
    clock = _Clock()
    membership = Membership(clock)
    membership.observe(_instance_beat("first"))
    generation = membership.generation
    _, _, quiet_until = membership.triage(["w0"], {"w0": clock.now})
    assert quiet_until == clock.now + MISSED_BEATS * BEAT_S
    clock.now += BEAT_S
    membership.observe(_instance_beat("first"))
    assert membership.still_quiet(generation, quiet_until), "a regular beat changes nothing"
    clock.now = quiet_until
    assert not membership.still_quiet(generation, quiet_until), "it could have expired by now"
    clock.now -= 2 * BEAT_S
    _, _, quiet_until = membership.triage(["w0"], {"w0": clock.now})
    clock.now += 2.8 * BEAT_S
    assert membership.still_quiet(generation, quiet_until)
    membership.observe(_instance_beat("first"))
    assert not membership.still_quiet(generation, quiet_until), "back after a missed beat"
    generation = membership.generation
    membership.observe(msgspec.structs.replace(_instance_beat("first"), interval_s=BEAT_S / 4))
    assert not membership.still_quiet(generation, math.inf), "a shorter beat expires sooner"
