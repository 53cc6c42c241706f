"""Encoders and decoders, built once and reused (a fresh decode is ~12x slower).

Every message is untrusted input: a :class:`Reader` refuses anything over
:data:`MAX_MESSAGE_BYTES` before parsing it, and turns every way a payload can
be wrong (not JSON, wrong shape, an unknown tag, an out-of-range number,
nesting deep enough to exhaust the parser's recursion) into one
:class:`BadPayload`, so a receiver needs one ``except`` to survive any input.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from lorabus.schemas.commands import Command
from lorabus.schemas.events import Event
from lorabus.schemas.reports import Ack, AckMessage, BeatMessage, Heartbeat, NodeAcks, NodeBeats
from lorabus.schemas.requests import (
    FleetStatus,
    MemberStatus,
    ResetRequest,
    ResetResult,
    ResultRequest,
    StatusRequest,
    UpdateRequest,
    UpdateResult,
)

_T = TypeVar("_T")

MAX_MESSAGE_BYTES = 1024 * 1024
"""The largest message any lorabus process decodes (NATS's default max payload)."""

_encoder = msgspec.json.Encoder()


class BadPayload(msgspec.DecodeError):
    """A payload that is not a valid message of the expected family."""


class Reader(Generic[_T]):
    """Decodes one message family from untrusted bytes; raises only BadPayload."""

    def __init__(self, kind: Any, *, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._decoder: msgspec.json.Decoder[_T] = msgspec.json.Decoder(kind)
        self.max_bytes = max_bytes

    def decode(self, data: bytes | bytearray | memoryview | str) -> _T:
        if isinstance(data, str):
            try:
                data = data.encode()
            except UnicodeEncodeError:
                raise BadPayload("not valid UTF-8") from None
        elif isinstance(data, memoryview):
            data = data.tobytes()
        if len(data) > self.max_bytes:
            raise BadPayload(f"{len(data)} bytes is over the limit of {self.max_bytes}")
        try:
            return self._decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise BadPayload(str(exc)) from None
        except RecursionError:
            raise BadPayload("nested too deeply") from None


any_decoder: Reader[Any] = Reader(Any)
"""Any JSON value, under the same limits (for the tap and the audit trail)."""

command_decoder: Reader[Command] = Reader(Command)
ack_decoder: Reader[Ack] = Reader(Ack)
heartbeat_decoder: Reader[Heartbeat] = Reader(Heartbeat)
ack_message_decoder: Reader[AckMessage] = Reader(AckMessage)
"""A worker's ack or a node's acks: whatever may arrive on an ack subject."""
beat_message_decoder: Reader[BeatMessage] = Reader(BeatMessage)
"""A worker's beat or a node's beats: whatever may arrive on a heartbeat subject."""
update_request_decoder: Reader[UpdateRequest] = Reader(UpdateRequest)
update_result_decoder: Reader[UpdateResult] = Reader(UpdateResult)
status_request_decoder: Reader[StatusRequest] = Reader(StatusRequest)
reset_request_decoder: Reader[ResetRequest] = Reader(ResetRequest)
result_request_decoder: Reader[ResultRequest] = Reader(ResultRequest)
reset_result_decoder: Reader[ResetResult] = Reader(ResetResult)
fleet_status_decoder: Reader[FleetStatus] = Reader(FleetStatus)
event_decoder: Reader[Event] = Reader(Event)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def to_builtins(message: msgspec.Struct) -> Any:
    """Plain dicts and lists, e.g. for ``--json`` output: a status's member
    rows with every field, also those the wire leaves out at their default
    (``MemberStatus``), so that scripts read them as before."""
    if isinstance(message, MemberStatus):
        return _member(message)
    plain = msgspec.to_builtins(message)
    if isinstance(message, FleetStatus):
        plain["members"] = [_member(member) for member in message.members]
    return plain


def _member(member: MemberStatus) -> Any:
    return msgspec.to_builtins(msgspec.structs.asdict(member))


def json_schema() -> dict[str, Any]:
    """The JSON Schema of every message family, keyed by subject family."""
    families: dict[str, Any] = {
        "command": Command,
        "ack": Ack,
        "heartbeat": Heartbeat,
        "node_acks": NodeAcks,
        "node_beats": NodeBeats,
        "update_request": UpdateRequest,
        "update_result": UpdateResult,
        "status_request": StatusRequest,
        "fleet_status": FleetStatus,
        "result_request": ResultRequest,
        "reset_request": ResetRequest,
        "reset_result": ResetResult,
        "event": Event,
    }
    names = list(families)
    schemas, components = msgspec.json.schema_components(families.values())
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "lorabus wire contract",
        "properties": dict(zip(names, schemas, strict=True)),
        "$defs": components,
    }
