"""The members of a placed update: the workers its placement chooses, waited
for as ``placement.py`` says, and what older agents could not take.

An update that asks for ``replicas`` or a selector runs on the workers the
leader chooses (:func:`wait_placed`), not on the fleet's quorum. An update
from a tenant's store, or a placed one, is refused while a live agent of an
older wire version beats (:func:`check_versions`): it would fail to fetch
from the store, or serve the adapter everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

from lorabus.adapters.bus_paths import store_of
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.coordinator.membership import Member, Membership
from lorabus.coordinator.placement import (
    Served,
    never_placeable,
    place,
    unplaceable,
    wait_for_whom,
)
from lorabus.coordinator.plan import UpdatePlan
from lorabus.errors import BadRequest, QuorumNotReached
from lorabus.schemas import PLACED_SINCE, TENANT_STORES_SINCE, Heartbeat

HEARD_EVERYONE_AFTER_S = 10.0
"""A coordinator that has listened this long has heard every agent that
beats at least that often (every second by default): from then on, a
placement no worker it remembers can meet fails at once; before, it waits
for its quorum as any update does."""


def check_versions(plan: UpdatePlan, live: Mapping[str, Member]) -> None:
    """Refuse what live agents of older wire versions would get wrong: a
    tenant's store (``bus:<tenant>/...``) and placement."""
    needs = [
        (TENANT_STORES_SINCE, "an adapter from a tenant's store", bool(store_of(plan.path))),
        (PLACED_SINCE, "placement", not plan.placement.everywhere),
    ]
    for since, what, asked in needs:
        older = sorted(w for w, m in live.items() if m.heartbeat.v < since)
        if asked and older:
            raise BadRequest(
                f"{what} needs every agent at wire version {since} or later; "
                f"{', '.join(older[:8])} run(s) an older one"
            )


def beside(plan: UpdatePlan, placing: Mapping[str, Served]) -> list[Served]:
    """What engines serve while ``plan`` runs: what is committed, and the new
    versions of the other placed updates running (``placing``)."""
    others = (s for uid, s in placing.items() if uid != plan.update_id)
    return [*plan.beside, *others]


async def wait_placed(
    plan: UpdatePlan,
    membership: Membership,
    config: CoordinatorConfig,
    placing: dict[str, Served],
) -> dict[str, int]:
    """The workers ``plan`` runs on, by world size, once chosen; the choice
    goes into ``placing`` at once, so that the next placed update counts
    it. BadRequest for a placement no remembered worker can meet (once the
    coordinator has heard them all), QuorumNotReached when too few
    workers are there after the quorum timeout."""
    placement = plan.placement
    never = never_placeable(placement, membership.remembered())
    if never is not None and membership.listening_for() >= HEARD_EVERYONE_AFTER_S:
        raise BadRequest(never)

    def not_gone(worker: str) -> bool:
        return membership.silent_for(worker) < config.replace_after_s

    def placed(live: dict[str, Heartbeat], *, wait: bool = True) -> dict[str, int] | None:
        if wait and wait_for_whom(placement, live, plan.placed_on, not_gone):
            return None  # a worker that serves it now, or may, comes back first
        ready = {w: beat for w, beat in live.items() if beat.ready}
        chosen = place(
            plan.adapter,
            placement,
            ready,
            now_on=plan.placed_on,
            own=plan.own_names,
            beside=beside(plan, placing),
        )
        if chosen is None:
            return None
        placing[plan.update_id] = Served(plan.served_name, tuple(chosen))
        return {w: ready[w].world_size for w in chosen}

    members = await membership.wait_for(placed, config.quorum_timeout_s)
    if members is None:  # waited long enough for those away: choose without them
        members = placed({w: m.heartbeat for w, m in membership.live().items()}, wait=False)
    if members is None:
        ready = {w: m.heartbeat for w, m in membership.live().items() if m.heartbeat.ready}
        raise QuorumNotReached(unplaceable(placement, ready, config.quorum_timeout_s))
    return members
