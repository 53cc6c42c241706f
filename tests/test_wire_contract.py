"""Messages round-trip, carry a version, tolerate new fields, and have a schema."""

from __future__ import annotations

import json

import msgspec
import pytest

from lorabus.schemas import (
    WIRE_VERSION,
    Ack,
    LoadCommand,
    LoadSpec,
    PauseCommand,
    Phase,
    PrepareCommand,
    ResumeCommand,
    Subjects,
    UnloadCommand,
    ack_decoder,
    command_decoder,
    encode,
    json_schema,
)

COMMANDS = [
    PrepareCommand(
        update_id="u1",
        cohort=True,
        budget_s=300,
        path="bus:sha256:" + "0" * 64,
        digest="sha256:" + "0" * 64,
    ),
    PauseCommand(update_id="u1", targets=["w1"], budget_s=5),
    PauseCommand(
        update_id="u1",
        cohort=True,
        budget_s=5,
        then_load=LoadSpec(served_name="p-v1", path="/a", digest="sha256:" + "0" * 64, budget_s=5),
    ),
    LoadCommand(update_id="u1", targets=["w1"], budget_s=5, served_name="p-v1", path="/a"),
    ResumeCommand(update_id="u1", targets=["w1", "w2"], budget_s=5),
    UnloadCommand(update_id="u1", targets=["w1"], budget_s=5, names=["p-v0"]),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: type(c).__name__)
def test_commands_round_trip_with_tag_and_version(command: object) -> None:
    wire = encode(command)  # type: ignore[arg-type]
    as_json = json.loads(wire)

    assert as_json["v"] == WIRE_VERSION == 11 and "type" in as_json
    assert command_decoder.decode(wire) == command


def test_unknown_fields_from_a_newer_peer_are_ignored() -> None:
    ack = Ack(
        update_id="u",
        phase=Phase.LOAD,
        worker_id="w1",
        ok=True,
        world_size=2,
        adapters=["p-v1"],
        paused=True,
    )
    newer = json.loads(encode(ack)) | {"gpu_temperature": 71}

    assert ack_decoder.decode(json.dumps(newer)) == ack


def test_a_pause_from_an_older_coordinator_with_its_mode_still_decodes() -> None:
    """Version-5 coordinators before the field went sent ``mode: "keep"``."""
    pause = PauseCommand(update_id="u", targets=["w1"], budget_s=5, lease_s=30.0)
    older = json.loads(encode(pause)) | {"mode": "keep"}

    assert command_decoder.decode(json.dumps(older)) == pause
    assert "mode" not in json.loads(encode(pause))


def test_an_unknown_command_type_is_a_decode_error() -> None:
    with pytest.raises(msgspec.DecodeError):
        command_decoder.decode(b'{"type": "reboot", "v": 1}')


def test_json_schema_covers_every_message_family() -> None:
    schema = json_schema()
    text = json.dumps(schema)

    assert set(schema["properties"]) == {
        "command",
        "ack",
        "heartbeat",
        "node_acks",
        "node_beats",
        "update_request",
        "update_result",
        "status_request",
        "fleet_status",
        "result_request",
        "reset_request",
        "reset_result",
        "event",
    }
    for tag in ("pause", "load", "resume", "unload", "update_started", "bad_message"):
        assert f'"{tag}"' in text


def test_subjects_follow_the_design() -> None:
    subjects = Subjects(fleet="prod")

    assert subjects.cmd() == "lorabus.prod.cmd"
    assert subjects.cmd_worker("w1") == "lorabus.prod.cmd.w1"
    assert subjects.ack("w1") == "lorabus.prod.ack.w1"
    assert subjects.heartbeat("w1") == "lorabus.prod.hb.w1"
    assert subjects.update_request() == "lorabus.prod.req.update"
    assert subjects.coordinator_event("bad_message") == "lorabus.prod.evt.coordinator.bad_message"
    assert subjects.agent_event("w1", "lease_expired") == "lorabus.prod.evt.agent.w1.lease_expired"
    assert subjects.event_any() == "lorabus.prod.evt.>"


@pytest.mark.parametrize("fleet", ["a.b", "a*", "", "a b", ">"])
def test_a_fleet_name_that_would_change_routing_is_refused(fleet: str) -> None:
    with pytest.raises(ValueError, match="fleet"):
        Subjects(fleet=fleet)
