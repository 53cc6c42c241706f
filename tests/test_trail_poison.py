"""No message can make the audit trail unreadable: each kind of poison published
on a fleet's audited subjects is reported by `tap` and `audit verify`, with
its sequence, and the good records around it are still printed and checked.

Everything runs against a real nats-server, the commands as processes.
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from processes import Finished, run_lorabus

from lorabus.bus.connect import close, connect
from lorabus.schemas import (
    MAX_MESSAGE_BYTES,
    Ack,
    EngineResumed,
    LeaderElected,
    Phase,
    Subjects,
    encode,
)
from lorabus.testbed.natsserver import NatsServer

TWO_MB = 2 * 1024 * 1024
LARGEST = "the largest payload the server takes, up to 2 MB"


@dataclass
class Published:
    good: dict[int, str]
    """seq -> the type of a good record."""
    poison: dict[int, str]
    """seq -> what its report must say (LARGEST: depends on the server)."""
    mismatch: int
    """seq of the ack whose body names another worker than its subject."""


def _ack(worker: str, epoch: int = 1) -> dict[str, object]:
    ack = Ack(
        update_id="u1",
        phase=Phase.RESUME,
        worker_id=worker,
        ok=True,
        world_size=1,
        adapters=[],
        paused=False,
        epoch=epoch,
    )
    return msgspec.to_builtins(ack)  # type: ignore[no-any-return]


async def _publish_poisoned_trail(url: str, fleet: str) -> Published:
    """Good records with every kind of poison between them, in stream order."""
    provisioned = await run_lorabus("provision", "--nats", url, "--fleet", fleet)
    assert provisioned.returncode == 0, provisioned
    s = Subjects(fleet=fleet)
    nc = await connect(url, name="test-poisoner")
    published = Published(good={}, poison={}, mismatch=0)

    stored = 0

    async def put(subject: str, payload: bytes) -> int:
        # The audit stream sends no "stored" answers (an ack's reply subject
        # could aim one into the fleet): one publisher, so sequences count up.
        nonlocal stored
        await nc.publish(subject, payload)
        await nc.flush()
        stored += 1
        return stored

    async def good(subject: str, message: msgspec.Struct, tag: str) -> None:
        published.good[await put(subject, encode(message))] = tag

    async def poison(subject: str, payload: bytes, what: str) -> None:
        published.poison[await put(subject, payload)] = what

    nested = "[" * 100_000 + "]" * 100_000
    deep = (json.dumps(_ack("w1"))[:-1] + f', "unknown": {nested}}}').encode()
    huge_int = json.dumps({**_ack("w1"), "epoch": 2**70}).encode()
    largest = min(TWO_MB, nc.max_payload)
    try:
        await good(
            s.coordinator_event("leader_elected"),
            LeaderElected(ts=1.0, source="coordinator", holder="c1", epoch=1),
            "leader_elected",
        )
        await poison(s.ack("w1"), b"not json \x1b[31m", "JSON is malformed")
        await good(
            s.agent_event("w1", "engine_resumed"),
            EngineResumed(ts=1.0, source="agent:w1", worker_id="w1", reason="agent start", epoch=1),
            "engine_resumed",
        )
        await poison(s.cmd(), b"[" * 100_000, "Expected `object`, got `array`")
        await poison(s.ack("w1"), deep, "nested too deeply")
        await good(s.ack("w1"), msgspec.convert(_ack("w1"), Ack), "ack")
        await poison(s.ack("w1"), huge_int, "<= 9223372036854775807 - at `$.epoch`")
        await poison(
            s.coordinator_event("self_destruct"),
            b'{"type": "self_destruct", "ts": 1, "source": "coordinator"}',
            "Invalid value 'self_destruct' - at `$.type`",
        )
        await poison(
            s.agent_event("w1", "reconciled"),
            b'"' + b"a" * (largest - 2) + b'"',
            LARGEST,
        )
        published.mismatch = await put(s.ack("w1"), encode(msgspec.convert(_ack("w2"), Ack)))
        await poison(s.ack("w\x1b[2J"), b"\x1b[2Jboom", "JSON is malformed")
        await good(
            s.coordinator_event("leader_elected"),
            LeaderElected(ts=2.0, source="coordinator", holder="c2", epoch=2),
            "leader_elected",
        )
        # Every message published is stored, in order, before anyone reads.
        async with asyncio.timeout(10):
            while (await nc.jetstream().stream_info(s.audit_stream())).state.last_seq < stored:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    finally:
        await close(nc)
    return published


@pytest.fixture
async def poisoned(nats_url: str, fleet_name: str) -> Published:
    return await _publish_poisoned_trail(nats_url, fleet_name)


def _assert_escaped(finished: Finished) -> None:
    assert "\x1b" not in finished.stdout, "a control character reached the terminal"
    assert "\\x1b" in finished.stdout, finished


def _assert_verified(verified: Finished, published: Published, total: int) -> None:
    assert verified.returncode == 1, verified
    reported = {
        int(m.group(2)): (m.group(1), m.group(0))
        for m in re.finditer(r"^(\w+): .* \(records \[(\d+)\]\)$", verified.stdout, re.M)
    }
    expected = {seq: "poison_record" for seq in published.poison}
    expected[published.mismatch] = "subject_mismatch"
    assert {seq: rule for seq, (rule, _) in reported.items()} == expected, verified
    for seq, said in published.poison.items():
        assert said == LARGEST or said in reported[seq][1], (said, reported[seq])
    poison = len(published.poison)
    summary = f"audit: {total} records, {poison + 1} violation(s), {poison} of them poison"
    assert verified.stdout.splitlines()[-1] == summary, verified
    _assert_escaped(verified)


async def test_tap_prints_each_poison_record_by_sequence_between_the_good_ones(
    poisoned: Published, nats_url: str, fleet_name: str
) -> None:
    tapped = await run_lorabus("tap", "--nats", nats_url, "--fleet", fleet_name, "--no-follow")

    assert tapped.returncode == 0, tapped
    lines = tapped.stdout.splitlines()
    for seq, said in poisoned.poison.items():
        reported = [line for line in lines if re.search(rf" {seq} POISON '", line)]
        assert len(reported) == 1, (seq, tapped)
        assert said == LARGEST or said in reported[0], (said, reported)
    for seq, tag in poisoned.good.items():
        assert [line for line in lines if re.search(rf" {seq} e\d+ \S+ +{tag} ", line)], (
            seq,
            tapped,
        )
    mismatched = [line for line in lines if f" {poisoned.mismatch} e1 " in line]
    assert len(mismatched) == 1 and "MISMATCH" in mismatched[0], tapped
    _assert_escaped(tapped)


async def test_audit_verify_live_reports_each_poison_record_and_checks_the_rest(
    poisoned: Published, nats_url: str, fleet_name: str
) -> None:
    verified = await run_lorabus(
        "audit", "verify", "--live", "--nats", nats_url, "--fleet", fleet_name
    )

    total = len(poisoned.good) + len(poisoned.poison) + 1
    _assert_verified(verified, poisoned, total)


async def test_a_tapped_file_with_poison_and_broken_lines_still_verifies_and_resumes(
    poisoned: Published, nats_url: str, fleet_name: str, tmp_path: Path
) -> None:
    trail = tmp_path / "trail.jsonl"
    common = ["--nats", nats_url, "--fleet", fleet_name, "--no-follow", "--out", str(trail)]
    tapped = await run_lorabus("tap", *common)
    total = len(poisoned.good) + len(poisoned.poison) + 1
    from_file = await run_lorabus("audit", "verify", str(trail))
    with trail.open("ab") as file:
        file.write(b"not json\n" + b"[" * 100_000 + b"\n")
        file.write(b'{"seq": 99, "subject": "lorabus.x.ack.w\\u001b", "ts": "late"}\n')
    broken = await run_lorabus("audit", "verify", str(trail))
    again = await run_lorabus("tap", *common)

    assert tapped.returncode == 0, tapped
    _assert_verified(from_file, poisoned, total)
    assert broken.returncode == 1, broken
    for number in (total + 1, total + 2):
        assert f"poison_record: line {number} of {trail}: not a trail record" in broken.stdout
    claimed = f"line {total + 3} of {trail} (record 99 on 'lorabus.x.ack.w\\x1b'): not a trail"
    assert claimed in broken.stdout, broken
    assert f"audit: {total} records, {len(poisoned.poison) + 4} violation(s)" in broken.stdout
    assert again.returncode == 0, again
    assert len(trail.read_bytes().splitlines()) == total + 3, "nothing written twice"


@pytest.fixture
async def roomy_server() -> AsyncIterator[NatsServer]:
    """A nats-server that accepts payloads of 4 MB (the default is 1 MiB)."""
    with tempfile.TemporaryDirectory(prefix="lorabus-poison-") as folder:
        conf = Path(folder) / "max_payload.conf"
        conf.write_text("max_payload: 4MB\n")
        async with NatsServer(include=conf) as server:
            yield server


async def test_a_payload_over_the_size_limit_is_a_poison_record(
    roomy_server: NatsServer, fleet_name: str
) -> None:
    url = roomy_server.url
    poisoned = await _publish_poisoned_trail(url, fleet_name)
    oversize = [seq for seq, what in poisoned.poison.items() if what == LARGEST]
    tapped = await run_lorabus("tap", "--nats", url, "--fleet", fleet_name, "--no-follow")
    verified = await run_lorabus("audit", "verify", "--live", "--nats", url, "--fleet", fleet_name)

    assert len(oversize) == 1
    assert tapped.returncode == 0, tapped
    poison_line = [line for line in tapped.stdout.splitlines() if f" {oversize[0]} POISON" in line]
    assert f"over the limit of {MAX_MESSAGE_BYTES}" in poison_line[0], tapped
    assert f"{TWO_MB} bytes" in poison_line[0], tapped
    _assert_verified(verified, poisoned, len(poisoned.good) + len(poisoned.poison) + 1)


def test_a_line_too_long_to_be_a_record_is_reported_and_reading_goes_on(tmp_path: Path) -> None:
    from lorabus.audit.trail_file import MAX_LINE_BYTES, read_trail
    from lorabus.audit.verify import TrailRecord

    good = TrailRecord(seq=3, subject="lorabus.f.ack.w1", ts=1.0, kind="ack", message=_ack("w1"))
    trail = tmp_path / "trail.jsonl"
    trail.write_bytes(b"x" * (MAX_LINE_BYTES + 10) + b"\n" + encode(good) + b"\n")
    read = read_trail(trail)

    assert read.records == [good]
    assert [bad.number for bad in read.bad_lines] == [1]
    assert f"over the limit of {MAX_LINE_BYTES}" in read.bad_lines[0].error
