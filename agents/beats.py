"""When an agent may skip a heartbeat: an ack already said what it would.

During an update an agent acks every phase, and each ack carries the engine's
adapter list and paused flag; the coordinator takes both from it and counts
the ack as a sign of life. A beat that would tell the coordinator nothing new
since the last beat and that ack is skipped, so at N = 1024 the coordinator
does not read a thousand redundant heartbeats per update.

Never two without a beat sent between them: a coordinator that does not know
this worker yet (a standby started since, or a new leader) learns of it only
from a beat, and it still hears one at least every two periods, well within
the three missed beats after which a worker counts as gone.
"""

from __future__ import annotations

import msgspec

from lorabus.schemas import Ack, Heartbeat


class BeatPolicy:
    """Decides, at each tick of an agent's heartbeat loop, whether to beat."""

    def __init__(self) -> None:
        self._last_beat: Heartbeat | None = None
        self._ack_since_beat: Ack | None = None
        self._skipped_since_beat = False

    def beat_sent(self, beat: Heartbeat) -> None:
        """A beat went out, from the heartbeat loop or any other."""
        self._last_beat = beat
        self._ack_since_beat = None
        self._skipped_since_beat = False

    def ack_sent(self, ack: Ack) -> None:
        self._ack_since_beat = ack

    def should_beat(self, beat: Heartbeat) -> bool:
        """Whether ``beat``, the heartbeat this tick would send, must go out."""
        if self._skipped_since_beat:
            return True
        ack, last = self._ack_since_beat, self._last_beat
        if ack is None or last is None:
            return True
        # What the coordinator holds: the last beat, with the ack's engine state.
        known = msgspec.structs.replace(last, adapters=ack.adapters, paused=ack.paused)
        if known != beat:
            return True
        self._skipped_since_beat = True
        return False
