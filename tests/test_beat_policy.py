"""When an agent skips a heartbeat: only one an ack made redundant, never two
without a beat going out between them."""

from __future__ import annotations

import msgspec

from lorabus.agents.beats import BeatPolicy
from lorabus.schemas import Ack, Heartbeat, Phase


def _beat(adapters: list[str], *, paused: bool = False, ready: bool = True) -> Heartbeat:
    return Heartbeat(
        worker_id="w0",
        world_size=1,
        engine="dynamo",
        adapters=adapters,
        paused=paused,
        interval_s=1.0,
        ready=ready,
    )


def _ack(adapters: list[str], *, paused: bool) -> Ack:
    return Ack(
        update_id="u1",
        phase=Phase.LOAD,
        worker_id="w0",
        ok=True,
        world_size=1,
        adapters=adapters,
        paused=paused,
    )


def test_a_beat_goes_out_when_no_ack_was_sent_since_the_last() -> None:
    policy = BeatPolicy()
    assert policy.should_beat(_beat([])), "the first beat always goes out"
    policy.beat_sent(_beat([]))

    assert all(policy.should_beat(_beat([])) for _ in range(3))


def test_a_beat_that_an_ack_made_redundant_is_skipped_but_never_two_in_a_row() -> None:
    policy = BeatPolicy()
    policy.beat_sent(_beat([]))
    policy.ack_sent(_ack(["p-v1"], paused=True))
    now_beat = _beat(["p-v1"], paused=True)

    ticks = [policy.should_beat(now_beat) for _ in range(3)]

    assert ticks == [False, True, True], "the beats after a skip fail until one goes out"
    policy.beat_sent(now_beat)
    assert policy.should_beat(now_beat), "no ack since that beat"
    policy.ack_sent(_ack(["p-v1"], paused=True))
    assert not policy.should_beat(now_beat), "a beat went out: one may be skipped again"


def test_a_beat_goes_out_when_it_says_more_than_the_last_beat_and_ack() -> None:
    policy = BeatPolicy()
    policy.beat_sent(_beat([]))
    policy.ack_sent(_ack(["p-v1"], paused=False))

    assert policy.should_beat(_beat(["p-v1", "p-v2"])), "the engine's adapters moved on"
    assert policy.should_beat(_beat(["p-v1"], paused=True)), "paused since the ack"
    assert policy.should_beat(_beat(["p-v1"], ready=False)), "no longer ready"
    changed = msgspec.structs.replace(_beat(["p-v1"]), epoch_seen=4)
    assert policy.should_beat(changed), "a higher epoch seen"
    assert not policy.should_beat(_beat(["p-v1"])), "nothing new: skipped"
