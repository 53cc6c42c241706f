"""Valid messages of every family, the documented bounds, and poison made from them.

Shared by the decoder property tests (``test_decoders_property.py``) and the
live poison tests (``test_poison_live.py``). Poison is built as JSON text by
hand, not by ``json.dumps``: a bound is only tested if the payload can say
what no Python value serialises to (``1e400`` written literally, a key twice).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from lorabus.schemas import (
    INT64_MAX,
    MAX_WORLD_SIZE,
    Ack,
    BadMessage,
    CommandHandled,
    CommandRefused,
    CommittedNotice,
    CommittedReset,
    EngineResumed,
    ErrorCode,
    ErrorInfo,
    FleetStatus,
    Heartbeat,
    LeaderElected,
    LeaseExpired,
    LoadCommand,
    MemberAlert,
    MemberStatus,
    PauseCommand,
    Phase,
    PhaseFinished,
    RankMap,
    Reader,
    Reconciled,
    RefuseInstance,
    RenewLeaseCommand,
    ResetRequest,
    ResetResult,
    ResultRequest,
    ResumeCommand,
    StatusRequest,
    UnloadCommand,
    UpdateFinished,
    UpdateRequest,
    UpdateResult,
    UpdateStarted,
    WorkerConflict,
    WorkerIdConflict,
    WorkerOutcome,
    ack_decoder,
    any_decoder,
    build_rank_map,
    command_decoder,
    event_decoder,
    fleet_status_decoder,
    heartbeat_decoder,
    reset_request_decoder,
    reset_result_decoder,
    result_request_decoder,
    status_request_decoder,
    update_request_decoder,
    update_result_decoder,
)

# -- JSON text with what json.dumps cannot write ------------------------------


@dataclass(frozen=True)
class Raw:
    """JSON text written as it is: ``1e400``, ``NaN``, a nest of 100000 brackets."""

    text: bytes


@dataclass(frozen=True)
class Pairs:
    """A JSON object as a list of pairs, so a key can appear twice."""

    items: tuple[tuple[str, Any], ...]


def render(value: Any) -> bytes:
    """``value`` as JSON text; :class:`Raw` and :class:`Pairs` as they say."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Pairs | dict):
        items = value.items if isinstance(value, Pairs) else value.items()
        return b"{" + b",".join(render(str(k)) + b":" + render(v) for k, v in items) + b"}"
    if isinstance(value, list | tuple):
        return b"[" + b",".join(render(item) for item in value) + b"]"
    return json.dumps(value).encode()


def nest(depth: int) -> Raw:
    return Raw(b"[" * depth + b"]" * depth)


HUGE_FLOAT = Raw(b"1e400")
"""A float no double holds, written literally."""

# -- one valid message of every type, every field set -------------------------

_RANK_MAP = build_rank_map({"w000": 2, "w001": 1})
_ERROR = ErrorInfo(code=ErrorCode.ENGINE_ERROR, message="the engine said no")
_COMMAND = {"update_id": "u-1", "targets": ["w000"], "budget_s": 30.0, "epoch": 3}
_EVENT = {"ts": 1_700_000_000.5, "source": "agent:w000", "epoch": 3}


@dataclass(frozen=True)
class Family:
    """One message family: the reader of its subject and what it may return."""

    name: str
    reader: Reader[Any]
    types: tuple[type, ...]
    samples: tuple[Any, ...]


FAMILIES = (
    Family(
        "command",
        command_decoder,
        (
            PauseCommand,
            LoadCommand,
            ResumeCommand,
            UnloadCommand,
            RenewLeaseCommand,
            CommittedNotice,
            RefuseInstance,
        ),
        (
            PauseCommand(**_COMMAND, cohort=True, excluded=["w009"], lease_s=30.0),
            LoadCommand(**_COMMAND, served_name="policy-v1", path="/adapters/1", replace=True),
            ResumeCommand(**_COMMAND, cohort=True, excluded=["w009"]),
            UnloadCommand(**_COMMAND, names=["policy-v0"]),
            RenewLeaseCommand(**_COMMAND, lease_s=30.0),
            CommittedNotice(
                **_COMMAND,
                served_name="policy-v1",
                path="/adapters/1",
                version=1,
                retire=["policy-v0"],
                lineage=1,
            ),
            RefuseInstance(**_COMMAND, instance="a1b2", holder="c3d4"),
        ),
    ),
    Family(
        "ack",
        ack_decoder,
        (Ack,),
        (
            Ack(
                update_id="u-1",
                phase=Phase.LOAD,
                worker_id="w000",
                ok=False,
                world_size=2,
                adapters=["policy-v1"],
                paused=True,
                error=_ERROR,
                duration_s=0.5,
                epoch=3,
                instance="a1b2",
            ),
        ),
    ),
    Family(
        "heartbeat",
        heartbeat_decoder,
        (Heartbeat,),
        (
            Heartbeat(
                worker_id="w000",
                world_size=2,
                engine="dynamo",
                adapters=["policy-v1"],
                paused=False,
                interval_s=1.0,
                ready=False,
                epoch_seen=3,
                instance="a1b2",
            ),
        ),
    ),
    Family(
        "update_request",
        update_request_decoder,
        (UpdateRequest,),
        (UpdateRequest(update_id="u-1", adapter="policy", path="/adapters/1", version=1),),
    ),
    Family(
        "update_result",
        update_result_decoder,
        (UpdateResult,),
        (
            UpdateResult(
                update_id="u-1",
                status="committed",
                adapter="policy-v1",
                version=1,
                rank_map=_RANK_MAP,
                phases={"pause": 0.1, "load": 0.2},
                workers={
                    "w000": WorkerOutcome(
                        ok=False, world_size=2, error=_ERROR, adapters=["policy-v1"]
                    )
                },
                error=_ERROR,
                path="/adapters/1",
            ),
        ),
    ),
    Family(
        "result_request",
        result_request_decoder,
        (ResultRequest,),
        (ResultRequest(update_id="u-1"),),
    ),
    Family(
        "reset_request",
        reset_request_decoder,
        (ResetRequest,),
        (ResetRequest(adapter="policy", reason="ticket 42", expected_version=9),),
    ),
    Family(
        "reset_result",
        reset_result_decoder,
        (ResetResult,),
        (
            ResetResult(
                adapter="policy",
                ok=False,
                lineage=1,
                previous_version=9,
                previous_path="/adapters/9",
                error=_ERROR,
            ),
        ),
    ),
    Family(
        "status_request",
        status_request_decoder,
        (StatusRequest,),
        (StatusRequest(),),
    ),
    Family(
        "fleet_status",
        fleet_status_decoder,
        (FleetStatus,),
        (
            FleetStatus(
                fleet="f1",
                expected_world_size=3,
                live_world_size=3,
                members=[
                    MemberStatus(
                        worker_id="w000",
                        world_size=2,
                        engine="dynamo",
                        paused=False,
                        adapters=["policy-v1"],
                        heartbeat_age_s=0.1,
                        rank_offset=1,
                        ready=True,
                    )
                ],
                committed_adapter="policy-v1",
                committed_version=1,
                rank_map=_RANK_MAP,
                in_flight="u-2",
                epoch=3,
                leader="c1",
                in_flight_phase="load",
                acked=["w000"],
                waiting=["w001"],
                conflicts=[WorkerIdConflict(worker_id="w001", holder="a", refused="b", age_s=1.0)],
            ),
        ),
    ),
    Family(
        "event",
        event_decoder,
        (
            UpdateStarted,
            PhaseFinished,
            UpdateFinished,
            CommandHandled,
            BadMessage,
            CommandRefused,
            LeaseExpired,
            Reconciled,
            LeaderElected,
            EngineResumed,
            WorkerConflict,
            CommittedReset,
            MemberAlert,
        ),
        (
            UpdateStarted(
                **_EVENT, update_id="u-1", adapter="policy", version=1, members={"w000": 2}
            ),
            PhaseFinished(
                **_EVENT,
                update_id="u-1",
                phase=Phase.LOAD,
                ok=False,
                duration_s=0.2,
                missing=["w001"],
                failed=["w000"],
            ),
            UpdateFinished(
                **_EVENT,
                update_id="u-1",
                status="committed",
                error=_ERROR,
                adapter="policy-v1",
                rank_map=_RANK_MAP,
            ),
            CommandHandled(
                **_EVENT,
                update_id="u-1",
                phase=Phase.UNLOAD,
                worker_id="w000",
                ok=False,
                error=_ERROR,
            ),
            BadMessage(**_EVENT, subject="lorabus.f1.cmd", error="not JSON", size=9),
            CommandRefused(
                ts=1.5,
                source="agent:w000",
                update_id="u-1",
                worker_id="w000",
                command="pause",
                epoch=2,
                epoch_seen=3,
                reason="older epoch",
            ),
            LeaseExpired(**_EVENT, update_id="u-1", worker_id="w000", resumed=True, error=_ERROR),
            Reconciled(**_EVENT, worker_id="w000", served_name="policy-v1", ok=True, error=_ERROR),
            LeaderElected(ts=1.5, source="coordinator", holder="c1", epoch=3, recovered="u-1"),
            EngineResumed(**_EVENT, worker_id="w000", reason="agent start"),
            WorkerConflict(
                **_EVENT, worker_id="w000", holder="a1", refused="b2", world_sizes=[2, 1]
            ),
            CommittedReset(
                **_EVENT,
                adapter="policy",
                lineage=1,
                previous_version=9,
                previous_path="/adapters/9",
                previous_served_name="policy-v9",
                reason="ticket 42",
            ),
            MemberAlert(
                **_EVENT, worker_id="w000", condition="not_ready", reason="gone", cleared=True
            ),
        ),
    ),
    Family(
        "any",
        any_decoder,
        (dict, list, str, int, float, bool, type(None)),
        ({"any": ["json", 1, 2.5, True, None]},),
    ),
)

FAMILY = {family.name: family for family in FAMILIES}

# -- the documented bounds (docs/protocol.md, Bounds) --------------------------

MAX_NAMES = 65536
MAX_NAME = 256
MAX_PATH = 4096
MAX_SECONDS = 86400.0
_WORKER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_UPDATE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
"""The documented patterns, matched whole: ``re.fullmatch`` (a ``$`` would also
match before a final newline)."""

WORKER_ID_FIELDS = {"worker_id"}
WORKER_ID_LISTS = {"targets", "excluded"}
NAME_LISTS = {"adapters", "names", "retire"}
INT64_FIELDS = {
    "version",
    "epoch",
    "epoch_seen",
    "committed_version",
    "lineage",
    "previous_version",
    "expected_version",
}
SECONDS_FIELDS = {"budget_s", "lease_s", "duration_s"}


def _exempt(owner: type, name: str) -> bool:
    # The coordinator itself answers a request that does not decode with an
    # update_result of update_id "" (coordinator/service.py, _malformed), and
    # a rank map's world_size is the whole group's: 1 + every member's.
    return (owner, name) in {(UpdateResult, "update_id"), (RankMap, "world_size")}


def bound_violations(message: Any) -> list[str]:
    """Every field of ``message`` (nested structs included) that breaks a
    documented bound, as ``path=value (bound)``; empty when all hold."""
    return [f"{where}={_short(value)} ({why})" for where, value, why in _walk(message, "$")]


def _walk(value: Any, where: str) -> Iterator[tuple[str, Any, str]]:
    if isinstance(value, msgspec.Struct):
        for name in type(value).__struct_fields__:
            field = getattr(value, name)
            at = f"{where}.{name}"
            if not _exempt(type(value), name):
                why = _broken_bound(name, field)
                if why is not None:
                    yield at, field, why
            yield from _walk(field, at)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _walk(item, f"{where}[{key!r}]")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _walk(item, f"{where}[{index}]")


def _broken_bound(name: str, value: Any) -> str | None:
    if name in WORKER_ID_FIELDS and not _matches(_WORKER_ID, value):
        return "a worker id is 1-64 letters, digits, '_' or '-'"
    if name in WORKER_ID_LISTS:
        if len(value) > MAX_NAMES:
            return f"at most {MAX_NAMES} entries"
        if not all(_matches(_WORKER_ID, item) for item in value):
            return "a worker id is 1-64 letters, digits, '_' or '-'"
    if name == "update_id" and not _matches(_UPDATE_ID, value):
        return "an update id matches ^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
    if name in INT64_FIELDS and value is not None and not 0 <= value <= INT64_MAX:
        return "versions and epochs are 0 to 2^63 - 1"
    if name == "world_size" and not 1 <= value <= MAX_WORLD_SIZE:
        return f"a world size is 1 to {MAX_WORLD_SIZE}"
    if name in SECONDS_FIELDS and not (math.isfinite(value) and 0 <= value <= MAX_SECONDS):
        return f"seconds are 0 to {MAX_SECONDS:g}"
    if name == "interval_s" and not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        return f"a beat period is above 0 and at most {MAX_SECONDS:g}"
    if name in NAME_LISTS:
        if len(value) > MAX_NAMES:
            return f"at most {MAX_NAMES} entries"
        if any(len(item) > MAX_NAME for item in value):
            return f"names are at most {MAX_NAME} characters"
    if name == "path" and value is not None and not 1 <= len(value) <= MAX_PATH:
        return f"a path is 1 to {MAX_PATH} characters"
    return None


def _matches(pattern: re.Pattern[str], value: Any) -> bool:
    return isinstance(value, str) and pattern.fullmatch(value) is not None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


# -- values that break each bound ---------------------------------------------

_BAD_WORKER_IDS = {
    "a space": "w 000",
    "a dot": "w.000",
    "a final newline": "w000\n",
    "nothing": "",
    "65 characters": "w" * 65,
}
_BAD_INT64 = {"-1": -1, "2^63": 2**63, "2^64 - 1": 2**64 - 1, "2^70": 2**70, "1e400": HUGE_FLOAT}
_BAD_SECONDS = {"-1": -1.0, "86400.5": 86400.5, "1e300": 1e300, "1e400": HUGE_FLOAT}

BREAKERS: dict[str, dict[str, Any]] = {
    **{name: _BAD_WORKER_IDS for name in WORKER_ID_FIELDS},
    **{
        name: {
            **{label: [bad] for label, bad in _BAD_WORKER_IDS.items()},
            "65537 entries": ["w0"] * (MAX_NAMES + 1),
        }
        for name in WORKER_ID_LISTS
    },
    "update_id": {
        "a space": "u 1",
        "a final newline": "u-1\n",
        "nothing": "",
        "a leading dot": ".u-1",
        "a path": "../../etc",
        "129 characters": "u" * 129,
    },
    **{name: _BAD_INT64 for name in INT64_FIELDS},
    "world_size": {"0": 0, "4097": MAX_WORLD_SIZE + 1, "-1": -1, "2^70": 2**70},
    **{name: _BAD_SECONDS for name in SECONDS_FIELDS},
    "interval_s": {"0": 0.0, "-1": -1.0, "86400.5": 86400.5, "1e400": HUGE_FLOAT},
    **{
        name: {"65537 entries": ["a"] * (MAX_NAMES + 1), "a name of 257": ["n" * 257]}
        for name in NAME_LISTS
    },
    "path": {"nothing": "", "4097 characters": "/" + "p" * MAX_PATH},
}
"""Field name -> {what is wrong: a value that breaks its documented bound}."""


def bounded_fields(tree: Any, where: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every field of a JSON tree that has a documented bound."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key in BREAKERS:
                yield (*where, key)
            yield from bounded_fields(value, (*where, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from bounded_fields(value, (*where, index))


def replaced(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A copy of ``tree`` with the value at ``path`` replaced."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        return {k: replaced(v, rest, value) if k == head else v for k, v in tree.items()}
    return [replaced(v, rest, value) if i == head else v for i, v in enumerate(tree)]


def as_tree(message: Any) -> Any:
    """A message as the JSON tree it is sent as."""
    return msgspec.to_builtins(message)


def exempt_at(sample: Any, path: tuple[Any, ...]) -> bool:
    """Whether :func:`bound_violations` exempts the field at ``path`` of ``sample``."""
    owner: Any = sample
    for key in path[:-1]:
        owner = owner[key] if isinstance(owner, list | dict) else getattr(owner, key)
    return isinstance(owner, msgspec.Struct) and _exempt(type(owner), path[-1])


# -- poison for a live fleet ---------------------------------------------------

DEEP = 100_000


def poison_payloads(
    base: dict[str, Any],
    *,
    id_field: str,
    bad_ids: Mapping[str, Any],
    int_field: str,
    float_field: str,
    largest: int,
) -> dict[str, bytes]:
    """Each kind of poison, made from the valid message ``base``: what it is -> payload.

    ``id_field`` gets each of ``bad_ids``, and the padding of the largest
    payload (exactly ``largest`` bytes, that id thousands of characters long).
    """
    padless = render({**base, id_field: _like(base.get(id_field), "")})
    pad = "x" * (largest - len(padless))
    payloads = {
        "not JSON": b"{not json",
        f"{DEEP} open brackets": b"[" * DEEP,
        "a deeply nested unknown field": render({**base, "junk": nest(DEEP)}),
        f"{int_field} of 2^70": render({**base, int_field: 2**70}),
        "an unknown type tag": render({**base, "type": "explode"}),
        f"the largest payload the server takes ({largest} bytes)": render(
            {**base, id_field: _like(base.get(id_field), pad)}
        ),
        **{
            f"{id_field} with {what}": render({**base, id_field: _like(base.get(id_field), bad)})
            for what, bad in bad_ids.items()
        },
        f"{float_field} of 1e400 written literally": render({**base, float_field: HUGE_FLOAT}),
    }
    assert all(len(payload) <= largest for payload in payloads.values())
    return payloads


def _like(current: Any, value: str) -> Any:
    """``value`` in the shape of the field it replaces (a list of ids, or one)."""
    return [value] if isinstance(current, list) else value
