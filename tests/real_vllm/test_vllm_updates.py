"""lorabus rolls adapters out on real vLLM 0.32.0 servers, as a user runs it.

A coordinator (``--frontend-url`` at a vLLM server, which lists its adapters
in ``/v1/models``) and one ``lorabus agent --engine vllm`` per server run as
processes against the tier's two servers, and an orchestrator's
``UpdateClient`` asks for each version. What is checked is what the real
servers say: their ``/v1/models``, ``/is_paused``, their access logs (every
pause and resume they answered), and greedy completions under the served
name, whose token ids show which weights answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from lorabus.client import UpdateClient
from lorabus.schemas import Naming, UpdateMode
from real_vllm.vllm_server import (
    BASE_MODEL,
    MAX_LORA_RANKS,
    TEST_TIMEOUT_S,
    VllmFleet,
    greedy_tokens,
    is_paused,
    served_adapters,
)

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(TEST_TIMEOUT_S)]

UPDATE_TIMEOUT_S = 120.0
RETIRE_DEADLINE_S = 30.0
PAUSE, RESUME = ("POST", "/pause?mode=keep"), ("POST", "/resume")
UNLOAD = ("POST", "/v1/unload_lora_adapter")
COMPLETION = ("POST", "/v1/completions")
RESET = ("POST", "/reset_prefix_cache?reset_running_requests=true")


async def _tokens(http: httpx.AsyncClient, vllm: VllmFleet, model: str) -> dict[str, list[int]]:
    return {w: await greedy_tokens(http, vllm.url(w), model) for w in MAX_LORA_RANKS}


def _counts(vllm: VllmFleet, request: tuple[str, str]) -> dict[str, int]:
    return {w: vllm.servers[w].access_log(*request) for w in MAX_LORA_RANKS}


async def _retired(http: httpx.AsyncClient, vllm: VllmFleet, gone: str) -> dict[str, set[str]]:
    """Each server's adapters once ``gone`` is no longer listed, or at the deadline."""
    deadline = time.monotonic() + RETIRE_DEADLINE_S
    while True:
        listed = {w: set(await served_adapters(http, vllm.url(w))) for w in MAX_LORA_RANKS}
        if not any(gone in names for names in listed.values()) or time.monotonic() > deadline:
            return listed
        await asyncio.sleep(0.2)


async def test_versions_commit_in_pause_and_live_mode_and_both_servers_answer_with_them(
    vllm: VllmFleet,
    client: UpdateClient,
    http: httpx.AsyncClient,
    adapters: Path,
    start_lorabus: Callable[..., Awaitable[None]],
) -> None:
    await start_lorabus()
    base = await _tokens(http, vllm, BASE_MODEL)

    # Version 1 (adapter a), in the coordinator's mode: pause.
    first = await client.update(
        "served", str(adapters / "a"), version=1, timeout_s=UPDATE_TIMEOUT_S
    )
    assert first.committed, first.error
    assert first.adapter == "served-v1"
    for worker_id in MAX_LORA_RANKS:
        served = await served_adapters(http, vllm.url(worker_id))
        assert served.get("served-v1") == str(adapters / "a"), (worker_id, served)
        assert "served-v1" in first.workers[worker_id].adapters
    with_a = await _tokens(http, vllm, "served-v1")
    assert with_a["w000"] == with_a["w001"], "two replicas answer differently with one adapter"
    assert with_a["w000"] != base["w000"], "the adapter does not change what the model answers"

    # Version 2 (adapter b), pause mode asked for by the request: each engine
    # is paused once and resumed, and not left paused.
    pauses, resumes = _counts(vllm, PAUSE), _counts(vllm, RESUME)
    completions = _counts(vllm, COMPLETION)
    second = await client.update(
        "served", str(adapters / "b"), version=2, mode=UpdateMode.PAUSE, timeout_s=UPDATE_TIMEOUT_S
    )
    assert second.committed, second.error
    assert second.adapter == "served-v2"
    assert {"pause", "load", "verify", "resume", "canary"} <= set(second.phases), second.phases
    # Each agent's canary asked its own server (and the coordinator's, one of them).
    assert all(_counts(vllm, COMPLETION)[w] > n for w, n in completions.items()), completions
    for worker_id in MAX_LORA_RANKS:
        assert not await is_paused(http, vllm.url(worker_id)), worker_id
    assert _counts(vllm, PAUSE) == {w: n + 1 for w, n in pauses.items()}
    assert all(_counts(vllm, RESUME)[w] > n for w, n in resumes.items()), resumes
    with_b = await _tokens(http, vllm, "served-v2")
    assert with_b["w000"] == with_b["w001"]
    assert with_b["w000"] not in (base["w000"], with_a["w000"])

    # Version 3 (adapter a again), live mode: loaded beside v2, no engine paused.
    pauses, resumes = _counts(vllm, PAUSE), _counts(vllm, RESUME)
    third = await client.update(
        "served", str(adapters / "a"), version=3, mode=UpdateMode.LIVE, timeout_s=UPDATE_TIMEOUT_S
    )
    assert third.committed, third.error
    assert third.adapter == "served-v3"
    assert "pause" not in third.phases and "resume" not in third.phases, third.phases
    assert _counts(vllm, PAUSE) == pauses, "a live update paused an engine"
    assert _counts(vllm, RESUME) == resumes
    for worker_id in MAX_LORA_RANKS:
        assert not await is_paused(http, vllm.url(worker_id)), worker_id
    assert await _tokens(http, vllm, "served-v3") == with_a
    assert await _tokens(http, vllm, "served-v2") == with_b

    # Beyond --keep (2), each agent retires v1 after the commit.
    listed = await _retired(http, vllm, "served-v1")
    for names in listed.values():
        assert "served-v1" not in names and {"served-v2", "served-v3"} <= names, listed


async def test_a_fixed_name_is_replaced_in_place_and_a_version_that_fails_keeps_the_old(
    vllm: VllmFleet,
    client: UpdateClient,
    http: httpx.AsyncClient,
    adapters: Path,
    start_lorabus: Callable[..., Awaitable[None]],
    tmp_path: Path,
) -> None:
    """With ``--naming fixed`` every version is served as ``served``: version 2
    swaps adapter b's weights in over a's (``load_inplace``), and version 3,
    a folder vLLM finds no adapter in, fails on both servers while b keeps
    answering under the name (an unload, then a load, would have left no
    ``served`` at all)."""
    await start_lorabus(naming=Naming.FIXED)
    first = await client.update(
        "served", str(adapters / "a"), version=1, timeout_s=UPDATE_TIMEOUT_S
    )
    assert first.committed, first.error
    with_a = await _tokens(http, vllm, "served")
    unloads, resets = _counts(vllm, UNLOAD), _counts(vllm, RESET)

    second = await client.update(
        "served", str(adapters / "b"), version=2, timeout_s=UPDATE_TIMEOUT_S
    )
    assert second.committed, second.error
    assert second.adapter == "served"
    with_b = await _tokens(http, vllm, "served")
    assert with_b["w000"] == with_b["w001"]
    assert with_b != with_a, "the weights under the name did not change"
    for worker_id in MAX_LORA_RANKS:
        served = await served_adapters(http, vllm.url(worker_id))
        assert served.get("served") == str(adapters / "b"), (worker_id, served)
    assert _counts(vllm, UNLOAD) == unloads, "the name was unloaded, not replaced"
    # No prefix the old weights computed serves the new ones under the name.
    assert _counts(vllm, RESET) == {w: n + 1 for w, n in resets.items()}

    empty = tmp_path / "no-adapter"
    empty.mkdir()
    third = await client.update("served", str(empty), version=3, timeout_s=UPDATE_TIMEOUT_S)

    assert third.status == "failed", third
    for worker_id in MAX_LORA_RANKS:
        served = await served_adapters(http, vllm.url(worker_id))
        assert served.get("served") == str(adapters / "b"), (worker_id, served)
        assert not await is_paused(http, vllm.url(worker_id)), worker_id
    assert await _tokens(http, vllm, "served") == with_b
