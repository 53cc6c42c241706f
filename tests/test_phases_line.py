"""The phases line of ``lorabus update`` and ``lorabus up`` shows each phase's
time, and a load the pause carried as the engines' own load time (its phase
alone reads about 0: it ran inside the pause)."""

from __future__ import annotations

from lorabus.audit.render import phase_timeline, result_text
from lorabus.schemas import UpdateResult, UpdateStatus


def _result(phases: dict[str, float], load_s: float) -> UpdateResult:
    return UpdateResult(
        update_id="u1",
        status=UpdateStatus.COMMITTED,
        adapter="policy-v1",
        version=1,
        phases=phases,
        load_s=load_s,
    )


def test_a_load_carried_by_the_pause_shows_the_engines_own_load_time() -> None:
    result = _result({"quorum": 0.001, "pause": 0.226, "load": 0.0, "resume": 0.01}, 0.2)

    line = phase_timeline(result)

    assert line == "quorum 1ms | pause 226ms | load 200ms (in the pause) | resume 10ms"
    assert "load 200ms (in the pause)" in result_text(result)


def test_a_load_of_its_own_shows_its_phase_and_the_canary_its_own() -> None:
    result = _result({"load": 0.3, "verify": 0.02, "canary": 0.015}, 0.25)

    assert phase_timeline(result) == "load 300ms | verify 20ms | canary 15ms"
