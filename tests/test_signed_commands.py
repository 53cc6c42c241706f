"""Agents obey only commands the leader signed, for the subject they arrive on,
once: a peer with publish rights on the command subjects still cannot drive
an engine, and a captured command cannot be moved or replayed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg

from lorabus.audit.tap import Tap
from lorabus.audit.verify import TrailRecord, decode_message
from lorabus.bus.connect import close
from lorabus.schemas import (
    CommandRefused,
    PauseCommand,
    Subjects,
    command_decoder,
    encode,
)
from lorabus.security.roles import Role
from lorabus.security.signing import CommandSigner, CommandVerifier, new_signing_seed
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 15.0
PAUSE = "/engine/pause_generation"


@pytest.fixture
async def stack(fleet_name: str) -> AsyncIterator[EmbeddedStack]:
    async with EmbeddedStack([1, 1], fleet=fleet_name, secure=True, heartbeat_s=0.2) as started:
        yield started


def _pauses(stack: EmbeddedStack) -> dict[str, int]:
    assert stack.sim is not None
    return {
        w: [r.path for r in worker.requests].count(PAUSE) for w, worker in stack.sim.workers.items()
    }


async def test_a_signed_fleet_commits_and_refuses_unsigned_moved_and_replayed_commands(
    stack: EmbeddedStack, fleet_name: str, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None and stack.coordinator is not None
    subjects = Subjects(fleet=fleet_name)
    # What w000 receives, headers and all, as the agent of w000 sees it.
    eavesdropper = await stack.bus_as(Role.AGENT, "w000").connect("test-w000-eavesdropper")
    # A peer allowed to publish commands (a second coordinator, a leaked credential).
    peer = await stack.bus_as(Role.COORDINATOR).connect("test-rogue-coordinator")
    auditor = await stack.bus_as(Role.AUDITOR).connect("test-auditor")
    captured: list[Msg] = []
    refusals: asyncio.Queue[CommandRefused] = asyncio.Queue()

    async def capture(msg: Msg) -> None:
        if isinstance(command_decoder.decode(msg.data), PauseCommand):
            captured.append(msg)

    async def on_record(record: TrailRecord) -> None:
        if not record.poison and isinstance(event := decode_message(record), CommandRefused):
            refusals.put_nowait(event)

    # The auditor reads events from the audit stream, its only source.
    following = asyncio.create_task(Tap(auditor, subjects).run(on_record, follow=True))
    try:
        await eavesdropper.subscribe(subjects.cmd_worker("w000"), cb=capture)
        await eavesdropper.flush()
        result = await stack.client.update("policy", make_adapter(1), version=1)
        assert result.committed, result.error
        assert captured, "the update's pause of w000 was not seen"
        real = captured[0]
        assert real.headers and "Lorabus-Sig" in real.headers
        before = _pauses(stack)
        epoch = stack.coordinator.epoch

        unsigned = PauseCommand(update_id="rogue", targets=["w001"], budget_s=5, epoch=epoch)
        await peer.publish(subjects.cmd_worker("w001"), encode(unsigned))
        other_key = CommandSigner(new_signing_seed())
        body = encode(msgspec.structs.replace(unsigned, update_id="resigned"))
        subject = subjects.cmd_worker("w001")
        await peer.publish(subject, body, headers=other_key.headers(subject, body))
        moved = msgspec.structs.replace(command_decoder.decode(real.data), targets=["w001"])
        await peer.publish(subjects.cmd_worker("w001"), encode(moved), headers=real.headers)
        # (The real pause as it is, on w001's subject, names w000 only: w001 ignores it.)
        await peer.publish(real.subject, real.data, headers=real.headers)
        await peer.flush()
        async with asyncio.timeout(DEADLINE_S):
            refused = [await refusals.get() for _ in range(4)]
        second = await stack.client.update("policy", make_adapter(2), version=2)
    finally:
        following.cancel()
        await asyncio.gather(following, return_exceptions=True)
        for nc in (eavesdropper, peer, auditor):
            await close(nc)

    reasons = sorted((r.worker_id, r.reason.split(":")[0].split(" ")[0]) for r in refused)
    assert reasons == [
        ("w000", "replayed"),
        ("w001", "the"),  # re-signed with another key: the signature does not match
        ("w001", "the"),  # moved onto w001's subject: the signature does not match
        ("w001", "unsigned"),
    ], [r.reason for r in refused]
    assert sum("does not match" in r.reason for r in refused) == 2
    assert _pauses(stack) == {w: n + 1 for w, n in before.items()}, "only update 2 paused them"
    assert second.committed, second.error


def test_a_verifier_refuses_keys_it_does_not_trust_and_records_the_first_on_first_use(
    tmp_path: Path,
) -> None:
    signer = CommandSigner(new_signing_seed())
    trust_file = tmp_path / "trusted-coordinator.key"
    first_use = CommandVerifier(trust_file=trust_file)
    headers = signer.headers("s", b"{}")
    assert first_use.check(signer.public_key, 1, "s", headers, b"{}") is None
    assert trust_file.read_text().strip() == signer.public_key

    stranger = CommandSigner(new_signing_seed())
    reason = CommandVerifier(trust_file=trust_file).check(
        stranger.public_key, 2, "s", stranger.headers("s", b"{}"), b"{}"
    )
    assert reason is not None and "does not trust" in reason
    with pytest.raises(ValueError, match="not an nkey public key"):
        middle = len(signer.public_key) // 2
        flipped = "B" if signer.public_key[middle] != "B" else "C"
        CommandVerifier([signer.public_key[:middle] + flipped + signer.public_key[middle + 1 :]])


def test_verifiers_in_one_process_share_proven_signatures_but_not_replay_checks() -> None:
    signer = CommandSigner(new_signing_seed())
    body = b'{"kind":"pause"}'
    headers = signer.headers("cmd", body)
    first, second = CommandVerifier([signer.public_key]), CommandVerifier([signer.public_key])
    # One broadcast reaches two agents of one process: both take it.
    assert first.check(signer.public_key, 1, "cmd", headers, body) is None
    assert second.check(signer.public_key, 1, "cmd", headers, body) is None
    # A signature proven once is still one command per agent.
    replayed = second.check(signer.public_key, 1, "cmd", headers, body)
    assert replayed is not None and replayed.startswith("replayed")
    # The proof covers these exact bytes: once a command is proven, the same
    # signature over another body or subject, or another sequence number, or
    # the same bytes under a key this agent does not pin, are still refused.
    later = signer.headers("cmd", body)
    assert (
        CommandVerifier([signer.public_key]).check(signer.public_key, 1, "cmd", later, body) is None
    )
    third = CommandVerifier([signer.public_key])
    for subject, payload, sent in (
        ("cmd", b'{"kind":"resume"}', later),
        ("cmd.w000", body, later),
        ("cmd", body, {**later, "Lorabus-Seq": "3"}),
    ):
        reason = third.check(signer.public_key, 1, subject, sent, payload)
        assert reason is not None and "does not match" in reason, (subject, payload)
    stranger = CommandSigner(new_signing_seed())
    untrusting = CommandVerifier([stranger.public_key])
    reason = untrusting.check(signer.public_key, 1, "cmd", later, body)
    assert reason is not None and "does not trust" in reason
    assert third.check(signer.public_key, 1, "cmd", later, body) is None
