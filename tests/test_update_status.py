"""A result's status is an ``UpdateStatus``, and the wire is what it was: the
bare string, decoded from what coordinators send today and encoded back
byte for byte."""

from __future__ import annotations

import msgspec
import pytest

from lorabus import UpdateStatus
from lorabus.schemas import (
    COMMITTED,
    FAILED,
    PENDING,
    UNKNOWN,
    BadPayload,
    UpdateResult,
    encode,
    update_result_decoder,
)

COMMITTED_TODAY = (
    b'{"type":"update_result","v":5,"update_id":"u-1","status":"committed",'
    b'"adapter":"policy-v1","version":1,"rank_map":{"world_size":2,"entries":'
    b'[{"worker_id":"w000","world_size":2,"rank_offset":1}],'
    b'"membership_version":"4a530be5806083b5"},"phases":{"pause":0.1,"load":0.2},'
    b'"load_s":0.2,"workers":{"w000":{"ok":true,"world_size":2,"error":null,"adapters":["policy-v1"]}},'
    b'"error":null,"path":"/adapters/1","digest":"","trimmed":[]}'
)
"""An update's result as a coordinator sends it (``load_s`` since wire version 10)."""
FAILED_TODAY = (
    b'{"type":"update_result","v":5,"update_id":"u-2","status":"failed",'
    b'"adapter":"policy-v2","version":2,"rank_map":null,"phases":{},"load_s":0.0,"workers":{},'
    b'"error":{"code":"phase_timeout","message":"load timed out"},'
    b'"path":"/adapters/2","digest":"","trimmed":[]}'
)
PENDING_TODAY = (
    b'{"type":"update_result","v":5,"update_id":"u-3","status":"pending",'
    b'"adapter":"policy","version":3,"rank_map":null,"phases":{},"load_s":0.0,"workers":{},'
    b'"error":null,"path":"/adapters/3","digest":"","trimmed":[]}'
)
"""The answer to a ``result_request`` for an update that is queued or running."""
UNKNOWN_TODAY = (
    b'{"type":"update_result","v":5,"update_id":"u-4","status":"unknown",'
    b'"adapter":"","version":null,"rank_map":null,"phases":{},"load_s":0.0,"workers":{},'
    b'"error":null,"path":null,"digest":"","trimmed":[]}'
)


@pytest.mark.parametrize(
    ("wire", "status"),
    [
        (COMMITTED_TODAY, UpdateStatus.COMMITTED),
        (FAILED_TODAY, UpdateStatus.FAILED),
        (PENDING_TODAY, UpdateStatus.PENDING),
        (UNKNOWN_TODAY, UpdateStatus.UNKNOWN),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_a_result_sent_today_decodes_to_its_status_and_encodes_back_byte_for_byte(
    wire: bytes, status: UpdateStatus
) -> None:
    result = update_result_decoder.decode(wire)

    assert result.status is status
    assert result.committed == (status is UpdateStatus.COMMITTED)
    assert encode(result) == wire


def test_the_status_names_are_the_enum_and_compare_as_the_strings() -> None:
    assert [COMMITTED, FAILED, PENDING, UNKNOWN] == list(UpdateStatus)
    assert [str(s) for s in UpdateStatus] == ["committed", "failed", "pending", "unknown"]
    assert UpdateStatus.PENDING == "pending" and f"{UpdateStatus.UNKNOWN}" == "unknown"


def test_a_result_built_with_a_plain_string_encodes_as_one_built_with_the_enum() -> None:
    by_text = UpdateResult(update_id="u", status="failed", adapter="a", version=None)
    by_enum = UpdateResult(update_id="u", status=FAILED, adapter="a", version=None)

    assert encode(by_text) == encode(by_enum)
    assert by_text == by_enum


def test_a_status_no_version_sends_is_refused_as_a_bad_payload() -> None:
    wire = FAILED_TODAY.replace(b'"failed"', b'"rolled_back"')

    with pytest.raises(BadPayload, match="status"):
        update_result_decoder.decode(wire)


def test_the_json_schema_lists_every_status() -> None:
    _, components = msgspec.json.schema_components([UpdateResult])

    assert components["UpdateStatus"]["enum"] == ["committed", "failed", "pending", "unknown"]
