"""The pause that carries its update's load: both gathered at once.

Each agent loads as soon as its own engine is paused, so the acks of the
pause and of the load are gathered together (``update_run.py``), and a
load is sent again only to a member whose pause held.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec

from lorabus.coordinator.deadline import first_resend_gap
from lorabus.coordinator.gather import AckRouter, PhaseGather
from lorabus.coordinator.phases import Gathering, PhaseOutcome
from lorabus.runtime.clock import now
from lorabus.schemas import LoadCommand, LoadSpec, Phase


@dataclass
class Carrying:
    """The acks of a pause and of the load it carries, gathered at once."""

    pause: PhaseGather
    load: PhaseGather
    first_loaded: asyncio.Event
    """Set at the first successful load: the frontend may be asked from then on."""
    pause_ended: float | None = None
    """When the fleet's pause ended (monotonic), once it has."""

    @classmethod
    def open(cls, acks: AckRouter, update_id: str, targets: list[str], epoch: int) -> Carrying:
        first_loaded = asyncio.Event()
        load = acks.expect(update_id, Phase.LOAD, targets, first_loaded, epoch)
        # Opened last, so the status shows the pause while it lasts.
        pause = acks.expect(update_id, Phase.PAUSE, targets, None, epoch)
        return cls(pause, load, first_loaded)

    def load_gathering(self) -> Gathering:
        """How the carried load is gathered: on the gather opened for it, sent
        already (only re-sends follow), its time what it adds after the pause."""
        return Gathering(
            opened=self.load,
            sent=True,
            resend_if=self.took_the_pause,
            counted_from=lambda: self.pause_ended if self.pause_ended is not None else now(),
        )

    def took_the_pause(self, worker_id: str) -> bool:
        """A load is sent again only to a member whose pause held: one whose
        pause failed, or which has not taken it, must not load (an agent of
        wire version 2 would)."""
        ack = self.pause.acks.get(worker_id)
        return ack is not None and ack.ok

    def loads_so_far(self, timeout_s: float) -> PhaseOutcome:
        """The loads as known when the pause failed the update (not waited for)."""
        return PhaseOutcome(
            phase=Phase.LOAD,
            acks=dict(self.load.acks),
            missing=sorted(self.load.waiting),
            lost=sorted(self.load.lost),
            duration_s=0.0,
            timeout_s=timeout_s,
        )


def carried_load(load_command: LoadCommand, budget_s: float) -> LoadSpec:
    """The load a pause of ``budget_s`` carries. Its ack may be held half the
    pause's first re-send gap: a pause acked with a load that is still
    running then gets its own ack before any re-send."""
    hold_s = min(first_resend_gap(budget_s), budget_s) / 2
    return msgspec.structs.replace(load_command.spec(), budget_s=budget_s, ack_hold_s=hold_s)


def may_have_landed(pause: PhaseOutcome) -> set[str]:
    """Members whose pause may have landed unanswered, and with it run the
    load it carried: a pause that landed after all (its ack late or lost),
    or one acked as failed with its outcome unknown (the engine maybe
    paused). The agent of the latter refuses the load, but which of the two
    the coordinator heard first is a race, and unloading a name an engine
    lacks succeeds."""
    unsure = {w for w, ack in pause.acks.items() if ack.paused and not ack.ok}
    return set(pause.missing) | set(pause.lost) | unsure
