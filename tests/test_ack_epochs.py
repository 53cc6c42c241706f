"""An ack counts only for the term whose command it answers.

An update id can run again in a later term (a successor re-runs what its
predecessor left in flight). A ``fenced`` ack that an agent sends to a command
of the earlier term (replayed, or late) names the same update and phase: it
must not count as the member's answer in the new term.
"""

from __future__ import annotations

from lorabus.coordinator.gather import AckRouter
from lorabus.schemas import Ack, ErrorCode, ErrorInfo, Phase


def _ack(epoch: int, ok: bool) -> Ack:
    return Ack(
        update_id="step-7",
        phase=Phase.PAUSE,
        worker_id="w000",
        ok=ok,
        world_size=1,
        adapters=[],
        paused=ok,
        error=None if ok else ErrorInfo(code=ErrorCode.FENCED, message="fenced"),
        epoch=epoch,
    )


def test_an_ack_to_an_earlier_terms_command_does_not_count_in_the_next() -> None:
    router = AckRouter()
    gather = router.expect("step-7", Phase.PAUSE, ["w000"], epoch=3)

    router.route(_ack(epoch=2, ok=False))
    assert not gather.complete and gather.acks == {}

    router.route(_ack(epoch=3, ok=True))
    assert gather.complete and gather.acks["w000"].ok
