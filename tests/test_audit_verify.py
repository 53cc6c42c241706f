"""`audit verify` finds each broken promise in a trail, and nothing in a clean one:
not in an update answered "already committed", nor in the epochs of an agent
restarted after the fleet's state was reset (both from real runs). A body that
disagrees with its subject is a violation, and is not replayed."""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Awaitable, Callable

import msgspec
import pytest
from processes import Processes, wait_live_workers

from lorabus.audit import verify as audit
from lorabus.audit.tap import Tap
from lorabus.audit.verify import TrailRecord, Violation, decode_message, origin_of, verify
from lorabus.bus.connect import close, connect
from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from lorabus.schemas import (
    Ack,
    CommandRefused,
    CommittedNotice,
    EngineResumed,
    Event,
    LeaseExpired,
    LoadCommand,
    PauseCommand,
    Phase,
    RankEntry,
    RankMap,
    RefuseInstance,
    ResumeCommand,
    Subjects,
    UpdateFinished,
    UpdateStarted,
    build_rank_map,
    tag_of,
    to_builtins,
)
from lorabus.simfleet import SimFleet
from lorabus.testbed.child_processes import ChildProcess
from lorabus.testbed.stack import EmbeddedStack

MEMBERS = {"a": 2, "b": 1}
SUBJECTS = Subjects(fleet="f")


def subject_of(message: msgspec.Struct) -> str:
    """The subject an honest sender publishes ``message`` on."""
    if isinstance(message, Ack):
        return SUBJECTS.ack(message.worker_id)
    source = getattr(message, "source", None)
    if source is None:  # a command
        return SUBJECTS.cmd()
    if source == "coordinator":
        return SUBJECTS.coordinator_event(tag_of(message))
    return SUBJECTS.agent_event(source.removeprefix("agent:"), tag_of(message))


def record_of(seq: int, message: msgspec.Struct, subject: str | None = None) -> TrailRecord:
    subject = subject or subject_of(message)
    return TrailRecord(
        seq=seq,
        subject=subject,
        ts=float(seq),
        kind=origin_of(subject).kind,
        message=to_builtins(message),
    )


def _trail(*messages: msgspec.Struct) -> list[TrailRecord]:
    return [record_of(seq, message) for seq, message in enumerate(messages, start=1)]


def _ack(
    worker: str,
    phase: Phase,
    update: str = "u1",
    *,
    ok: bool = True,
    epoch: int = 1,
    instance: str = "",
) -> Ack:
    return Ack(
        instance=instance,
        update_id=update,
        phase=phase,
        worker_id=worker,
        ok=ok,
        world_size=MEMBERS[worker],
        adapters=[],
        paused=phase is Phase.PAUSE,
        epoch=epoch,
    )


def _started(update: str = "u1") -> UpdateStarted:
    return UpdateStarted(
        ts=0,
        source="coordinator",
        update_id=update,
        adapter="p-v1",
        version=1,
        members=MEMBERS,
        epoch=1,
    )


def _finished(
    update: str = "u1", rank_map: RankMap | None = None, status: str = "committed"
) -> UpdateFinished:
    if rank_map is None and status == "committed":
        rank_map = build_rank_map(MEMBERS)
    return UpdateFinished(
        ts=0,
        source="coordinator",
        update_id=update,
        status=status,
        rank_map=rank_map,
        epoch=1,
        adapter="p-v1",
    )


def _clean_update(update: str = "u1") -> list[msgspec.Struct]:
    return [
        _started(update),
        *(_ack(w, Phase.PAUSE, update) for w in MEMBERS),
        *(_ack(w, Phase.LOAD, update) for w in MEMBERS),
        *(_ack(w, Phase.RESUME, update) for w in MEMBERS),
        _finished(update),
    ]


def _rules(*messages: msgspec.Struct) -> list[str]:
    return [violation.rule for violation in verify(_trail(*messages))]


def test_every_event_type_is_known_to_come_from_its_sender() -> None:
    """A type missing here would make every such event a ``subject_mismatch``."""
    tags = {cls.__struct_config__.tag for cls in typing.get_args(Event)}

    assert tags == audit._AGENT_EVENTS | audit._COORDINATOR_EVENTS


def test_a_clean_trail_has_no_violations() -> None:
    assert _rules(*_clean_update("u1"), *_clean_update("u2")) == []


def test_the_commands_of_an_update_are_no_violation() -> None:
    """The pause is broadcast to open the cohort; a re-sent one names its worker."""
    commands = [
        PauseCommand(update_id="u1", cohort=True, excluded=["gone"], budget_s=1, epoch=1),
        PauseCommand(update_id="u1", targets=["a"], budget_s=1, epoch=1),
        LoadCommand(
            update_id="u1", cohort=True, budget_s=1, epoch=1, served_name="p-v1", path="/p"
        ),
        ResumeCommand(update_id="u1", cohort=True, budget_s=1, epoch=1),
    ]
    trail = [
        record_of(seq, command, SUBJECTS.cmd_worker("a") if command.targets else SUBJECTS.cmd())
        for seq, command in enumerate(commands, start=1)
    ]
    trail += [record_of(seq, m) for seq, m in enumerate(_clean_update(), start=len(trail) + 1)]

    assert verify(trail) == []


def test_a_pause_never_resumed_is_found_with_the_record_that_shows_it() -> None:
    trail = _trail(
        _started(),
        _ack("a", Phase.PAUSE),
        _ack("b", Phase.PAUSE),
        _ack("a", Phase.RESUME),
        _finished(status="failed"),
    )
    violations = verify(trail)

    assert [v.rule for v in violations] == ["unresumed_pause"]
    assert "b" in violations[0].message and violations[0].seqs == [3]


def test_a_shared_pause_held_by_one_update_of_its_round_ends_at_the_last_resume() -> None:
    """Two updates share one pause of ``a``: the first's resume is held (its
    ack says the engine stays paused), the second's resumes it. With the
    second's resume missing, its pause was never resumed."""
    held = msgspec.structs.replace(_ack("a", Phase.RESUME, "u1"), paused=True)
    both = [
        _started("u1"),
        _started("u2"),
        _ack("a", Phase.PAUSE, "u1"),
        _ack("a", Phase.PAUSE, "u2"),
        held,
    ]

    ended = [_finished("u1", status="failed"), _finished("u2", status="failed")]
    assert verify(_trail(*both, _ack("a", Phase.RESUME, "u2"), *ended)) == []
    violations = verify(_trail(*both, *ended))
    assert [v.rule for v in violations] == ["unresumed_pause"]
    assert "update u2" in violations[0].message, violations


def test_a_pause_acked_inside_a_load_ack_and_never_resumed_is_found() -> None:
    """A quick load's ack carries its pause's (``with_pause``): that engine
    paused as surely as one whose pause was acked on its own."""
    a_load, b_load = (
        msgspec.structs.replace(_ack(w, Phase.LOAD), with_pause=True) for w in ("a", "b")
    )
    trail = _trail(_started(), a_load, b_load, _ack("a", Phase.RESUME), _finished(status="failed"))
    violations = verify(trail)

    assert [v.rule for v in violations] == ["unresumed_pause"]
    assert "b" in violations[0].message and violations[0].seqs == [3]


@pytest.mark.parametrize(
    "undo",
    [
        LeaseExpired(ts=0, source="agent:b", update_id="u1", worker_id="b", resumed=True),
        EngineResumed(ts=0, source="agent:b", worker_id="b", reason="agent start"),
    ],
)
def test_a_lease_expiry_or_a_restart_resume_counts_as_resumed(undo: msgspec.Struct) -> None:
    assert _rules(_started(), _ack("b", Phase.PAUSE), undo, _finished(status="failed")) == []


def test_a_committed_member_without_a_load_ack_is_found() -> None:
    messages = [
        m
        for m in _clean_update()
        if not (isinstance(m, Ack) and m.worker_id == "b" and m.phase is Phase.LOAD)
    ]
    assert _rules(*messages) == ["load_not_acked"]


def test_acting_on_an_older_epoch_than_seen_is_found() -> None:
    refused = CommandRefused(
        ts=0,
        source="agent:a",
        update_id="u2",
        worker_id="a",
        command="pause",
        epoch=1,
        epoch_seen=3,
    )
    assert _rules(*_clean_update(), refused, _ack("a", Phase.RESUME, "u2", epoch=2)) == [
        "stale_epoch_acted"
    ]


def test_a_rank_map_that_does_not_follow_from_the_membership_is_found() -> None:
    wrong = RankMap(
        world_size=4,
        membership_version="x",
        entries=[
            RankEntry(worker_id="a", world_size=2, rank_offset=1),
            RankEntry(worker_id="b", world_size=1, rank_offset=2),
        ],
    )
    messages = [*_clean_update()[:-1], _finished(rank_map=wrong)]
    assert _rules(*messages) == ["rank_map_mismatch"]


def test_an_update_that_never_finished_is_found() -> None:
    assert _rules(*_clean_update()[:-1]) == ["no_terminal_result"]


def _restarted(worker: str, epoch: int) -> EngineResumed:
    return EngineResumed(
        ts=0, source=f"agent:{worker}", worker_id=worker, reason="agent start", epoch=epoch
    )


def test_a_restarted_agent_is_held_to_the_epoch_it_started_with_not_its_predecessors() -> None:
    # w a's first process saw epoch 5; the fleet's state was reset, and its
    # next process started knowing epoch 1.
    before = [_ack("a", Phase.PAUSE, "u0", epoch=5), _ack("a", Phase.RESUME, "u0", epoch=5)]
    after = [_ack("a", Phase.PAUSE, "u1", epoch=1), _ack("a", Phase.RESUME, "u1", epoch=1)]
    assert _rules(*before, _restarted("a", 1), *after) == []
    assert _rules(*before, *after) == ["stale_epoch_acted", "stale_epoch_acted"]
    # What the new process read at start binds it.
    assert _rules(_restarted("a", 3), *after) == ["stale_epoch_acted", "stale_epoch_acted"]


def test_an_agent_that_started_without_an_epoch_may_act_on_the_first_it_learns() -> None:
    assert _rules(_restarted("a", 0), *_clean_update()) == []


def test_a_new_instance_starts_a_new_process_and_the_same_one_is_still_held() -> None:
    old = _ack("a", Phase.RESUME, "u0", epoch=5, instance="i1")
    new = _ack("a", Phase.RESUME, "u1", epoch=1, instance="i2")
    again = _ack("a", Phase.RESUME, "u2", epoch=1, instance="i1")
    assert _rules(old, new) == []
    assert _rules(old, _ack("a", Phase.RESUME, "u1", epoch=1, instance="i1")) == [
        "stale_epoch_acted"
    ]
    assert _rules(_ack("a", Phase.RESUME, "u0", epoch=5, instance="i2"), new) == [
        "stale_epoch_acted"
    ]
    assert _rules(new, _ack("a", Phase.RESUME, "u3", epoch=4, instance="i2"), again) == []


def test_an_update_answered_from_the_record_must_repeat_the_latest_commit() -> None:
    again = _finished("u2")
    assert _rules(*_clean_update("u1"), again) == []
    other = RankMap(
        world_size=3,
        membership_version="other",
        entries=[
            RankEntry(worker_id="a", world_size=1, rank_offset=1),
            RankEntry(worker_id="b", world_size=1, rank_offset=2),
        ],
    )
    assert _rules(*_clean_update("u1"), _finished("u2", rank_map=other)) == ["rank_map_mismatch"]


def _lie(seq: int, message: msgspec.Struct, subject: str) -> list[Violation]:
    return verify([record_of(seq, message, subject)])


@pytest.mark.parametrize(
    ("message", "subject", "said"),
    [
        (_ack("a", Phase.LOAD), SUBJECTS.ack("b"), "claims 'a'"),
        (
            EngineResumed(ts=0, source="agent:a", worker_id="a", reason="x"),
            SUBJECTS.agent_event("b", "engine_resumed"),
            "claims the source 'agent:a'",
        ),
        (
            EngineResumed(ts=0, source="agent:b", worker_id="a", reason="x"),
            SUBJECTS.agent_event("b", "engine_resumed"),
            "claims the worker 'a'",
        ),
        (
            EngineResumed(ts=0, source="agent:b", worker_id="b", reason="x"),
            SUBJECTS.agent_event("b", "reconciled"),
            "on the subject of 'reconciled' events",
        ),
        (
            UpdateFinished(ts=0, source="agent:b", update_id="u1", status="committed"),
            SUBJECTS.agent_event("b", "update_finished"),
            "is no agent's",
        ),
        (
            UpdateStarted(
                ts=0, source="agent:b", update_id="u1", adapter="p", version=1, members={}
            ),
            SUBJECTS.coordinator_event("update_started"),
            "claims the source 'agent:b'",
        ),
        (_finished(), SUBJECTS.coordinator_event("update_started"), "'update_started' events"),
        (
            LeaseExpired(ts=0, source="coordinator", update_id="u", worker_id="a", resumed=True),
            SUBJECTS.coordinator_event("lease_expired"),
            "no coordinator's",
        ),
        (
            PauseCommand(update_id="u1", targets=["a"], budget_s=1),
            SUBJECTS.cmd(),
            "opening no cohort",
        ),
        (
            PauseCommand(update_id="u1", cohort=True, budget_s=1),
            SUBJECTS.cmd_worker("b"),
            "addressed to []",
        ),
        (
            RefuseInstance(
                update_id="conflict", budget_s=1, instance="i2", holder="i1", targets=["a"]
            ),
            SUBJECTS.cmd(),
            "broadcast to the whole fleet",
        ),
        (
            PauseCommand(update_id="u1", targets=["a"], budget_s=1),
            SUBJECTS.cmd_worker("b"),
            "addressed to ['a']",
        ),
        (
            CommittedNotice(update_id="u1", budget_s=0, served_name="p", path="/p", version=1),
            SUBJECTS.cmd_worker("b"),
            "alone",
        ),
    ],
)
def test_a_body_that_disagrees_with_its_subject_is_a_violation(
    message: msgspec.Struct, subject: str, said: str
) -> None:
    violations = _lie(4, message, subject)

    assert [(v.rule, v.seqs) for v in violations] == [("subject_mismatch", [4])]
    assert said in violations[0].message, violations[0].message


def test_a_mismatched_record_is_not_replayed() -> None:
    """An ack on b's subject claiming a's load does not count as a's load ack."""
    forged = record_of(99, _ack("a", Phase.LOAD), SUBJECTS.ack("b"))
    honest = [m for m in _clean_update() if not (isinstance(m, Ack) and m.worker_id == "a")]
    trail = [*_trail(*honest), forged]

    assert sorted(v.rule for v in verify(trail)) == ["load_not_acked", "subject_mismatch"]


def test_poison_records_are_violations_and_the_rest_is_still_checked() -> None:
    clean = _trail(*_clean_update())
    poisoned = TrailRecord(
        seq=50, subject=SUBJECTS.ack("a"), ts=0, kind="ack", message={}, poison="not JSON"
    )
    edited = TrailRecord(
        seq=51, subject=SUBJECTS.ack("a"), ts=0, kind="ack", message={"type": "nope"}
    )
    nowhere = record_of(52, _ack("a", Phase.LOAD), "elsewhere.f.ack.a")
    paused = record_of(60, _ack("b", Phase.PAUSE, "u2"))
    violations = verify([*clean, poisoned, edited, nowhere, paused])

    assert [(v.rule, v.seqs) for v in violations] == [
        ("poison_record", [50]),
        ("poison_record", [51]),
        ("subject_mismatch", [52]),
        ("unresumed_pause", [60]),
    ]
    assert "not JSON" in violations[0].message


# -- real runs ------------------------------------------------------------------


async def _stream_trail(nats_url: str, fleet: str) -> list[TrailRecord]:
    nc = await connect(nats_url, name="test-audit")
    records: list[TrailRecord] = []

    async def keep(record: TrailRecord) -> None:
        records.append(record)

    try:
        await asyncio.wait_for(Tap(nc, Subjects(fleet=fleet)).run(keep, follow=False), 30)
    finally:
        await close(nc)
    return records


async def test_an_update_answered_already_committed_verifies_clean(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([2, 1]) as stack:
        assert stack.client is not None
        path = make_adapter(1)
        first = await stack.client.update("policy", path, version=1)
        again = await stack.client.update("policy", path, version=1)
        records = await _stream_trail(nats_url, fleet_name)

    assert first.committed and again.committed, (first.error, again.error)
    assert again.update_id != first.update_id and not again.phases, "answered from the record"
    assert verify(records) == []


async def test_an_agent_restarted_after_the_fleet_state_was_reset_verifies_clean(
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
    client: UpdateClient,
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
) -> None:
    sim = await start_sim({"w000": 1})

    def coordinator(holder: str) -> CoordinatorConfig:
        return CoordinatorConfig(
            fleet=fleet_name,
            frontend_url=sim.url,
            expected_world_size=1,
            holder=holder,
            leader_lease_s=1.0,
        )

    async def start_agent() -> ChildProcess:
        started = await processes.start_agents(
            {"w000": 1}, sim.system_url, frontend_url=sim.url, fleet=fleet_name, nats_url=nats_url
        )
        await wait_live_workers(client, ["w000"], processes=processes)
        return started["w000"]

    leader = await processes.start_coordinator(coordinator("c1"), nats_url=nats_url)
    agent = await start_agent()
    assert (await client.update("policy", make_adapter(1), version=1)).committed
    await processes.stop(leader)
    leader = await processes.start_coordinator(coordinator("c2"), nats_url=nats_url)
    await wait_live_workers(client, ["w000"], processes=processes)
    second = await client.update("policy", make_adapter(2), version=2)
    assert second.committed, second.error
    # The fleet's state is lost and set up again (its agents restarted): the
    # epochs count from 1 again, below the 2 that w000's first process saw.
    await processes.stop(leader)
    await processes.stop(agent)
    nc = await connect(nats_url, name="test-operator")
    try:
        await nc.jetstream().delete_key_value(Subjects(fleet=fleet_name).state_bucket())
    finally:
        await close(nc)
    await processes.start_coordinator(coordinator("c3"), nats_url=nats_url)
    await wait_live_workers(client, [], processes=processes)
    await start_agent()
    third = await client.update("policy", make_adapter(3), version=3)
    records = await _stream_trail(nats_url, fleet_name)

    assert third.committed, third.error
    acks = [decode_message(r) for r in records if r.kind == "ack"]
    assert {a.epoch for a in acks if a.update_id == second.update_id} == {2}
    assert {a.epoch for a in acks if a.update_id == third.update_id} == {1}
    assert verify(records) == []
