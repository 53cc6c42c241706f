"""Every decoder turns any input into a message within its bounds, or BadPayload.

Random bytes, random JSON values, and valid messages of every family mutated
(bytes flipped, cut or inserted; keys dropped, repeated or added; values
swapped for huge ints, ``1e400``, nests, wrong types, unknown tags, long or
malformed strings) go to every decoder. Each must either return a message of
its own family whose fields keep the bounds of docs/protocol.md, or raise
:class:`~lorabus.schemas.BadPayload`: a receiver has one ``except``, so any
other exception would kill the callback that met it.

Hypothesis runs derandomized, the same examples every run, so a failure here
is a finding, never a flake; it does not shrink (a failure's message names the
field and the payload), which keeps a failing run as short as a passing one.
"""

from __future__ import annotations

import array
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from poison import (
    BREAKERS,
    FAMILIES,
    FAMILY,
    HUGE_FLOAT,
    Family,
    Pairs,
    Raw,
    as_tree,
    bound_violations,
    bounded_fields,
    exempt_at,
    nest,
    render,
    replaced,
)

from lorabus.schemas import MAX_MESSAGE_BYTES, BadPayload

_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
_MORE = settings(_SETTINGS, max_examples=200)

# -- what a decoder may do with its input -------------------------------------


def _decode_all(payload: bytes) -> None:
    """Decode ``payload`` with every family's reader; fail on any exception
    but BadPayload, or on a message of another family."""
    for family in FAMILIES:
        try:
            outcome = family.reader.decode(payload)
        except BadPayload:
            continue
        except Exception as exc:
            pytest.fail(
                f"{family.name} decoder raised {type(exc).__name__}: {exc!r:.300} "
                f"on {payload[:200]!r} ({len(payload)} bytes)"
            )
        else:
            assert isinstance(outcome, family.types), (
                f"{family.name} decoder returned {type(outcome).__name__} on {payload[:200]!r}"
            )


def _assert_within_bounds(family: Family, payload: bytes) -> None:
    try:
        message = family.reader.decode(payload)
    except BadPayload:
        return
    broken = bound_violations(message)
    assert not broken, (
        f"{family.name} decoder accepted {type(message).__name__} breaking its "
        f"documented bounds: {broken} from {payload[:300]!r}"
    )


# -- strategies ------------------------------------------------------------------

_POISON_VALUES: list[Any] = [
    2**70,
    -(2**70),
    2**63,
    2**64 - 1,
    -1,
    0,
    HUGE_FLOAT,
    Raw(b"-1e400"),
    Raw(b"1e-400"),
    Raw(b"NaN"),
    Raw(b"Infinity"),
    Raw(b"01"),
    Raw(b"1.0e"),
    -0.0,
    5e-324,
    86400.5,
    1e300,
    True,
    None,
    "",
    " ",
    "w 000",
    "w.000",
    "w000\n",
    "u-1\n",
    "\u0000",
    "\ud800",
    "é" * 300,
    "x" * 5000,
    [],
    {},
    ["w 000"],
    ["w000\n"],
    [[[[[]]]]],
    {"type": "explode"},
    {"type": "pause"},
    nest(2000),
    nest(50_000),
]

_TAGS = [
    "pause",
    "load",
    "resume",
    "unload",
    "renew_lease",
    "committed",
    "refuse_instance",
    "ack",
    "heartbeat",
    "update_request",
    "update_result",
    "status_request",
    "fleet_status",
    "update_started",
    "phase_finished",
    "update_finished",
    "command_handled",
    "bad_message",
    "command_refused",
    "lease_expired",
    "reconciled",
    "leader_elected",
    "engine_resumed",
    "worker_conflict",
    "explode",
    "",
    "PAUSE",
]

_json_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats()
    | st.text(max_size=40)
)
_json_values = st.recursive(
    _json_leaves,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=30,
)
_values = st.sampled_from(_POISON_VALUES) | _json_values


def _paths(tree: Any, where: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON tree, the root included."""
    found = [where]
    if isinstance(tree, dict):
        for key, value in tree.items():
            found += _paths(value, (*where, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            found += _paths(value, (*where, index))
    return found


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _mutate_tree(data: st.DataObject, tree: Any) -> Any:
    """One change to the JSON tree of a message."""
    path = data.draw(st.sampled_from(_paths(tree)), label="path")
    target = _at(tree, path)
    action = data.draw(
        st.sampled_from(["replace", "drop", "repeat", "add", "retag", "wrap", "nest"]),
        label="action",
    )
    if action == "replace" or (action in {"drop", "repeat", "add"} and not path):
        return replaced(tree, path, data.draw(_values, label="value"))
    if action == "retag":
        tag = data.draw(st.sampled_from(_TAGS), label="tag")
        if isinstance(target, dict):
            return replaced(tree, path, {**target, "type": tag})
        return {**tree, "type": tag} if isinstance(tree, dict) else tree
    if action == "wrap":
        return replaced(tree, path, [target])
    if action == "nest":
        depth = data.draw(st.sampled_from([64, 1000, 20_000]))
        return replaced(tree, path, Raw(b"[" * depth + render(target) + b"]" * depth))
    parent, key = path[:-1], path[-1]
    owner = _at(tree, parent)
    if not isinstance(owner, dict):
        return replaced(tree, path, data.draw(_values, label="value"))
    items = list(owner.items())
    if action == "drop":
        items = [(k, v) for k, v in items if k != key]
    elif action == "repeat":
        items.append((key, data.draw(_values, label="value")))
    else:
        items.append((data.draw(st.text(max_size=20), label="key"), data.draw(_values)))
    return replaced(tree, parent, Pairs(tuple(items)))


def _mutate_bytes(data: st.DataObject, payload: bytes) -> bytes:
    """One change to the bytes of a message."""
    if not payload:
        return data.draw(st.binary(max_size=64))
    at = data.draw(st.integers(0, len(payload) - 1), label="at")
    action = data.draw(st.sampled_from(["flip", "cut", "insert", "truncate", "repeat"]))
    if action == "flip":
        bit = data.draw(st.integers(1, 255), label="xor")
        return payload[:at] + bytes([payload[at] ^ bit]) + payload[at + 1 :]
    if action == "cut":
        return payload[:at] + payload[at + data.draw(st.integers(1, 16)) :]
    if action == "insert":
        inserted = data.draw(
            st.binary(min_size=1, max_size=16)
            | st.sampled_from([b"\xff", b"\xc3", b'"', b"\\", b"{", b"[", b",", b":", b"\x00"])
        )
        return payload[:at] + inserted + payload[at:]
    if action == "truncate":
        return payload[:at]
    return payload[:at] + payload[at : at + 32] + payload[at:]


def _mutated(data: st.DataObject, family: Family) -> bytes:
    sample = data.draw(st.sampled_from(family.samples), label="sample")
    tree = as_tree(sample)
    for _ in range(data.draw(st.integers(1, 3), label="tree mutations")):
        tree = _mutate_tree(data, tree)
    payload = render(tree)
    for _ in range(data.draw(st.integers(0, 2), label="byte mutations")):
        payload = _mutate_bytes(data, payload)
    return payload


_NAMES = [family.name for family in FAMILIES]

# -- the properties ----------------------------------------------------------------


@_MORE
@given(payload=st.binary(max_size=512))
def test_random_bytes_decode_or_raise_bad_payload(payload: bytes) -> None:
    _decode_all(payload)


@_MORE
@given(value=_json_values)
def test_random_json_values_decode_or_raise_bad_payload(value: Any) -> None:
    _decode_all(render(value))


@pytest.mark.parametrize("name", _NAMES)
@_SETTINGS
@given(data=st.data())
def test_mutated_messages_decode_or_raise_bad_payload(name: str, data: st.DataObject) -> None:
    _decode_all(_mutated(data, FAMILY[name]))


@pytest.mark.parametrize("name", _NAMES)
@_SETTINGS
@given(data=st.data())
def test_what_a_mutated_message_decodes_to_keeps_the_documented_bounds(
    name: str, data: st.DataObject
) -> None:
    payload = _mutated(data, FAMILY[name])
    for family in FAMILIES:
        _assert_within_bounds(family, payload)


# -- every bound, one by one -------------------------------------------------------


@pytest.mark.parametrize("name", _NAMES)
def test_the_valid_samples_decode_to_themselves_within_their_bounds(name: str) -> None:
    family = FAMILY[name]
    for sample in family.samples:
        decoded = family.reader.decode(render(as_tree(sample)))
        assert decoded == sample
        assert bound_violations(decoded) == []


_SAMPLES = [
    pytest.param(family, sample, id=f"{family.name}:{type(sample).__name__}")
    for family in FAMILIES
    for sample in family.samples
    if family.name != "any"
]


@pytest.mark.parametrize(("family", "sample"), _SAMPLES)
def test_each_documented_bound_is_refused_as_bad_payload(family: Family, sample: Any) -> None:
    """Each bounded field of each message type, given each value that breaks
    its bound: the decoder must refuse it (docs/protocol.md, Bounds)."""
    tree = as_tree(sample)
    accepted = []
    for path in bounded_fields(tree):
        if exempt_at(sample, path):
            continue
        for what, bad in BREAKERS[path[-1]].items():
            payload = render(replaced(tree, path, bad))
            try:
                family.reader.decode(payload)
            except BadPayload:
                continue
            accepted.append(f"{'.'.join(map(str, path))} = {what}")
    assert not accepted, f"{type(sample).__name__} accepted: {accepted}"


# -- the limits of the reader itself -------------------------------------------------


@pytest.mark.parametrize("name", _NAMES)
def test_deep_nesting_anywhere_is_bad_payload(name: str) -> None:
    family = FAMILY[name]
    tree = as_tree(family.samples[0])
    for payload in (
        b"[" * 100_000,
        b'{"a":' * 100_000,
        render({**tree, "junk": nest(100_000)}) if isinstance(tree, dict) else b"",
        render({"junk": nest(100_000), **tree}) if isinstance(tree, dict) else b"",
    ):
        with pytest.raises(BadPayload):
            family.reader.decode(payload)


@pytest.mark.parametrize("name", _NAMES)
def test_a_message_of_exactly_the_limit_decodes_and_one_byte_more_is_bad_payload(
    name: str,
) -> None:
    family = FAMILY[name]
    sample = family.samples[0]
    body = render(as_tree(sample))
    padded = body + b" " * (MAX_MESSAGE_BYTES - len(body))
    assert family.reader.decode(padded) == sample
    with pytest.raises(BadPayload, match=str(MAX_MESSAGE_BYTES)):
        family.reader.decode(padded + b" ")


def test_the_size_limit_counts_bytes_whatever_the_input_type() -> None:
    """``decode`` takes str and any buffer too; the limit is MAX_MESSAGE_BYTES
    bytes. Each input is a valid message with an unknown field that takes it
    past the limit (as UTF-8, or as the buffer's bytes)."""
    parsed = []
    for family in FAMILIES:
        tree = as_tree(family.samples[0])
        euros = '"' + "\u20ac" * (MAX_MESSAGE_BYTES // 2) + '"'  # 1.5 MiB as UTF-8
        text = render({**tree, "pad": Raw(euros.encode())}).decode()
        body = render({**tree, "pad": "a" * (2 * MAX_MESSAGE_BYTES)})
        wide = memoryview(body + b" " * (-len(body) % 8)).cast("Q")
        for data in (text, wide):
            try:
                family.reader.decode(data)
            except BadPayload:
                continue
            kind = "str" if isinstance(data, str) else "memoryview of 8-byte items"
            parsed.append(f"{family.name} decoder on a {kind} of {_nbytes(data)} bytes")
    assert not parsed, f"over the limit but decoded: {parsed}"


def test_a_str_with_a_lone_surrogate_is_bad_payload() -> None:
    """``decode`` takes str; one that is not valid Unicode is malformed input too."""
    raised = []
    for family in FAMILIES:
        for text in ("\ud800", '{"type": "status_request", "x": "\udfff"}'):
            try:
                family.reader.decode(text)
            except BadPayload:
                continue
            except Exception as exc:
                raised.append(f"{family.name} decoder on {text!r}: {type(exc).__name__}: {exc}")
    assert not raised, raised


def test_bytearray_and_memoryview_input_decode_like_bytes() -> None:
    for family in FAMILIES:
        body = render(as_tree(family.samples[0]))
        for data in (bytearray(body), memoryview(body), memoryview(array.array("B", body))):
            assert family.reader.decode(data) == family.samples[0]


def _nbytes(data: str | memoryview) -> int:
    return len(data.encode()) if isinstance(data, str) else data.nbytes
