"""An update id names one update: asked again with the same content it gets
the first result (how a requester recovers a lost reply), with other content
a ``bad_request`` that names the first, never the first result; also from a
new leader that knows the id only from the fleet's KV, and from the CLI."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from processes import run_lorabus

from lorabus.client import UpdateClient
from lorabus.schemas import ErrorCode, UpdateRequest, UpdateResult, encode, update_result_decoder
from lorabus.testbed.stack import EmbeddedStack

LEASE_S = 0.5


def _refused(result: UpdateResult) -> str:
    assert result.status == "failed", result
    assert result.error is not None and result.error.code == ErrorCode.BAD_REQUEST, result
    return result.error.message


def _pauses(stack: EmbeddedStack) -> int:
    assert stack.sim is not None
    return sum(
        w.count_requests("POST", "/engine/pause_generation") for w in stack.sim.workers.values()
    )


async def test_other_content_under_a_used_id_is_refused_and_the_same_gets_the_first_result(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1, 2]) as stack:
        client = stack.client
        assert client is not None
        step_1, step_2 = make_adapter(1), make_adapter(2)
        first = await client.update("policy", step_1, version=1, update_id="step-1")
        pauses = _pauses(stack)
        new_version = await client.update("policy", step_2, version=2, update_id="step-1")
        new_path = await client.update("policy", step_2, version=1, update_id="step-1")
        new_adapter = await client.update("critic", step_1, version=1, update_id="step-1")
        again = await client.update("policy", step_1, version=1, update_id="step-1")
        status = await client.status()

    assert first.committed, first.error
    for refused in (new_version, new_path, new_adapter):
        assert f"'policy' version 1 from {step_1}" in _refused(refused)
    assert again == first
    assert _pauses(stack) == pauses, "no engine touched after the first"
    assert status.committed_version == 1


async def test_an_id_first_used_without_a_version_matches_the_version_it_ran_as(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    async with make_stack([1]) as stack:
        client = stack.client
        assert client is not None
        path = make_adapter(1)
        first = await client.update("policy", path, update_id="auto")
        no_version = await client.update("policy", path, update_id="auto")
        as_run = await client.update("policy", path, version=1, update_id="auto")
        next_one = await client.update("policy", path, version=2, update_id="auto")

    assert first.committed and first.version == 1, first
    assert no_version == as_run == first
    assert f"no version (one past the committed) from {path}, run as version 1" in _refused(
        next_one
    )


async def test_a_new_leader_refuses_other_content_for_an_id_it_knows_only_from_kv(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    step_1, step_2 = make_adapter(1), make_adapter(2)
    async with make_stack([1], leader_lease_s=LEASE_S) as before:
        assert before.client is not None
        first = await before.client.update("policy", step_1, version=1, update_id="step-1")
    assert first.committed, first.error

    async with make_stack([1], leader_lease_s=LEASE_S) as after:
        assert after.client is not None and after.coordinator is not None
        await asyncio.wait_for(after.coordinator.leading.wait(), 10)
        assert not after.coordinator.book.knows("step-1")
        new_path = await after.client.update("policy", step_2, version=1, update_id="step-1")
        new_version = await after.client.update("policy", step_1, version=2, update_id="step-1")
        new_adapter = await after.client.update("critic", step_1, version=1, update_id="step-1")
        again = await after.client.update("policy", step_1, version=1, update_id="step-1")
        pauses = _pauses(after)

    assert f"'policy-v1' version 1 from {step_1} (committed)" in _refused(new_path)
    _refused(new_version)
    _refused(new_adapter)
    assert again == first
    assert pauses == 0, "the new leader ran nothing"


async def test_the_cli_exits_1_with_the_refusal_when_an_update_id_is_reused(
    nats_url: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    def update(path: str, version: int, update_id: str) -> list[str]:
        return [
            "update",
            "--nats",
            nats_url,
            "--fleet",
            fleet_name,
            "--adapter",
            "policy",
            "--path",
            path,
            "--version",
            str(version),
            "--update-id",
            update_id,
        ]

    step_1, step_2 = make_adapter(1), make_adapter(2)
    async with make_stack([1]):
        first = await run_lorabus(*update(step_1, 1, "step-1"))
        reused = await run_lorabus(*update(step_2, 2, "step-1"))
        asked_again = await run_lorabus(*update(step_1, 1, "step-1"))
        bad_id = await run_lorabus(*update(step_2, 2, "../step-2"))

    assert first.returncode == 0, first
    assert reused.returncode == 1, reused
    assert "error [bad_request]" in reused.stdout, reused
    assert f"'policy' version 1 from {step_1}" in reused.stdout, reused
    assert asked_again.returncode == 0 and "COMMITTED" in asked_again.stdout, asked_again
    assert bad_id.returncode == 2 and "--update-id" in bad_id.stderr, bad_id


async def test_asks_on_one_inbox_get_one_answer(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    """A requester asks again on the inbox of its first ask while the update runs:
    it gets one answer, not one per ask (a secured coordinator may send only one
    response per request it heard: more are permission violations)."""
    async with make_stack([1, 1]) as stack:
        assert stack.client is not None and stack.sim is not None
        stack.sim.workers["w001"].set_faults(latency_s={"load": 2.0})
        nc = stack.client.nc
        subjects = stack.client.subjects
        inbox = nc.new_inbox()
        answers = await nc.subscribe(inbox)
        request = UpdateRequest(update_id="step-1", adapter="policy", path=make_adapter(1))
        for _ in range(3):
            await nc.publish(subjects.update_request(), encode(request), reply=inbox)
            await asyncio.sleep(0.3)
        first = update_result_decoder.decode((await answers.next_msg(timeout=30)).data)
        # Every answer was sent when the update finished: by the time the
        # coordinator answers a status request after it, all would be here.
        await stack.client.status()
        await nc.flush()

        assert first.committed, first.error
        assert answers.pending_msgs == 0, "more than one answer to one inbox"
        await answers.unsubscribe()


async def test_each_ask_of_the_client_has_a_reply_subject_of_its_own(
    make_adapter: Callable[[int], str],
    make_stack: Callable[..., EmbeddedStack],
) -> None:
    """The client asks again while a slow update runs. A re-ask can reach the
    coordinator just after it answered the previous one, and it answers that
    one too: on a secured server only a reply subject it has not answered yet
    may take it, so every ask needs its own."""
    async with make_stack([1, 1]) as stack:
        assert stack.client is not None and stack.sim is not None
        stack.sim.workers["w001"].set_faults(latency_s={"load": 1.5})
        nc = stack.client.nc
        heard = await nc.subscribe(stack.client.subjects.update_request())
        client = UpdateClient(nc, stack.client.subjects.fleet, reask_s=0.2)
        result = await client.update("policy", make_adapter(1), timeout_s=30)
        asks = []
        while heard.pending_msgs:
            asks.append((await heard.next_msg(timeout=1)).reply)
        await heard.unsubscribe()

    assert result.committed, result.error
    assert len(asks) >= 3, asks
    assert len(set(asks)) == len(asks), f"a reply subject was used twice: {asks}"
    assert len({reply.rsplit(".", 1)[0] for reply in asks}) == 1, "one subscription for all"
