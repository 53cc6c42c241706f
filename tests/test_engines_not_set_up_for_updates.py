"""A worker whose engine cannot take LoRA updates says why, is refused at once, and
is ready again once its engine is restarted the right way.

vLLM without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` or ``VLLM_SERVER_DEV_MODE``
serves neither its LoRA nor its pause routes; SGLang with more than one
data-parallel replica fails every LoRA load. The agent finds it out at start,
without changing anything, and its heartbeat (``lorabus status``) says what is
missing and how to turn it on until the engine has it; the coordinator
refuses an update at once, naming it. An engine that loses the setting while
its agent runs fails the update that reaches it with the same words, at once.

A real coordinator and real agents on a real nats-server, over simulated vLLM
and SGLang workers (``EngineSetup`` says how each engine was started).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from convergence_helpers import member_until
from engine_fleet import DEADLINE_S, StartFleet, engine_fleets

from lorabus.schemas import ErrorCode
from lorabus.simfleet import EngineSetup

QUORUM_TIMEOUT_S = 120.0
"""Far beyond each test's deadline: a refusal must come from the reason, not a timeout."""

#: (engine, how it was started, words the reason must hold, the call of an
#: update that fails on it), one per problem.
PROBLEMS = {
    "vllm without runtime LoRA updating": (
        "vllm",
        EngineSetup(lora_updating=False),
        ["serves no /v1/load_lora_adapter", "start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"],
        ("POST", "/v1/load_lora_adapter"),
    ),
    "vllm without dev mode": (
        "vllm",
        EngineSetup(dev_mode=False),
        ["serves no /pause", "start it with VLLM_SERVER_DEV_MODE=1"],
        ("POST", "/pause"),
    ),
    "sglang with data parallelism": (
        "sglang",
        EngineSetup(dp_size=2),
        ["runs 2 data-parallel replicas", "start it with --dp-size 1"],
        ("POST", "/load_lora_adapter"),
    ),
}


@pytest.fixture
async def start_fleet(nats_url: str, fleet_name: str, tmp_path: Path) -> AsyncIterator[StartFleet]:
    async with engine_fleets(nats_url, fleet_name, tmp_path) as start:
        yield start


@pytest.mark.parametrize("problem", list(PROBLEMS))
async def test_a_worker_whose_engine_cannot_take_updates_says_why_until_restarted_right(
    problem: str, start_fleet: StartFleet, make_adapter: Callable[[int], str]
) -> None:
    kind, setup, words, _ = PROBLEMS[problem]
    client, sim = await start_fleet(
        {"w000": kind, "w001": kind}, {"w000": setup}, quorum_timeout_s=QUORUM_TIMEOUT_S
    )
    broken = sim.workers["w000"]

    shown = await member_until(client, "w000", lambda m: bool(m.unready_reason))
    started = time.monotonic()
    refused = await client.update("policy", make_adapter(1), version=1)
    refused_after_s = time.monotonic() - started

    assert not shown.ready
    for word in words:
        assert word in shown.unready_reason, shown
    assert sim.system_url("w000") in shown.unready_reason, shown
    ok = await member_until(client, "w001", lambda m: True)
    assert ok.ready and not ok.unready_reason, ok
    assert refused.error is not None and refused.error.code == ErrorCode.QUORUM_TIMEOUT
    assert refused_after_s < DEADLINE_S, refused_after_s
    assert "w000" in refused.error.message and words[-1] in refused.error.message, refused.error
    assert broken.loads_received == 0 and not broken.paused

    # The operator restarts it with what it lacked.
    broken.set_setup(**dataclasses.asdict(EngineSetup()))
    fixed = await member_until(client, "w000", lambda m: m.ready)
    result = await client.update("policy", make_adapter(2), version=2)

    assert fixed.unready_reason == "", fixed
    assert result.committed, result.error
    assert all("policy-v2" in w.adapters and not w.paused for w in sim.workers.values())


@pytest.mark.parametrize("problem", list(PROBLEMS))
async def test_an_update_that_reaches_such_an_engine_fails_at_once_with_the_same_words(
    problem: str, start_fleet: StartFleet, make_adapter: Callable[[int], str]
) -> None:
    # The engine is restarted without the setting while its agent runs: the
    # agent has not asked again yet when the update comes.
    kind, setup, words, failing = PROBLEMS[problem]
    client, sim = await start_fleet(
        {"w000": kind, "w001": kind}, {}, quorum_timeout_s=QUORUM_TIMEOUT_S
    )
    broken = sim.workers["w000"]
    broken.set_setup(**dataclasses.asdict(setup))

    result = await client.update("policy", make_adapter(1), version=1)

    assert result.status == "failed"
    assert result.error is not None and "w000" in result.error.message, result.error
    error = result.workers["w000"].error
    assert error is not None and error.code == ErrorCode.ENGINE_ERROR, error
    for word in words:
        assert word in error.message, error
    assert broken.count_requests(*failing) == 1, broken.requests  # not retried
    assert not any(w.paused for w in sim.workers.values())
    assert all("policy-v1" not in w.adapters for w in sim.workers.values())
    # The failure makes the agent ask again: its heartbeat says why at once.
    shown = await member_until(client, "w000", lambda m: bool(m.unready_reason))
    assert words[-1] in shown.unready_reason and not shown.ready, shown
