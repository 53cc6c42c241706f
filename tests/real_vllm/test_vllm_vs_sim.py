"""The simulated vLLM worker answers like a real vLLM 0.32.0 server, request for request.

The same sequence of requests goes to the tier's real server w001 and to
a simulated vLLM worker (``simfleet/vllm_routes.py``); status codes, content
types and bodies are compared. ``/v1/models`` is compared on this test's own
adapters (other tests' stay loaded on the shared server) and on the base
model's id, ``root`` aside: the sim has no model directory.

Where they differ, the difference is listed in ``KNOWN`` with what the real
server does: the test fails on any other difference, and on a known one
that is gone (then drop it from the list).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_answers import Case, ask

from lorabus.simfleet import SimFleet
from lorabus.testbed.trainer import write_adapter
from real_vllm.vllm_server import BASE_MODEL, TEST_TIMEOUT_S, VllmFleet

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(TEST_TIMEOUT_S)]

JSON = {"content-type": "application/json"}
#: This test's adapter names all start so.
PREFIX = "vs-"

#: Differences seen against vLLM 0.32.0: case -> what the real server does.
_NO_CONTENT_TYPE = "200 plain text with no Content-Type; the sim's says application/octet-stream"
KNOWN = {
    # aiohttp adds a Content-Type to any body without one.
    "load": _NO_CONTENT_TYPE,
    "load in place": _NO_CONTENT_TYPE,
    "load, slash": _NO_CONTENT_TYPE,
    "unload, slash": _NO_CONTENT_TYPE,
    "unload": _NO_CONTENT_TYPE,
}


def normalize(body: Any, case: Case) -> Any:
    if case.path == "/v1/models" and isinstance(body, dict):
        models = body.get("data", [])
        base = [(m["id"], m["parent"]) for m in models if m.get("parent") is None]
        ours = [(m["id"], m["root"], m["parent"]) for m in models if m["id"].startswith(PREFIX)]
        return {"object": body.get("object"), "base": base, "adapters": sorted(ours)}
    return body


def cases(adapter: Path, other: Path, not_adapter: Path, missing: Path) -> list[Case]:
    def load(name: str, path: Path, **extra: Any) -> dict[str, Any]:
        return {"lora_name": name, "lora_path": str(path), **extra}

    load_path = "/v1/load_lora_adapter"
    unload_path = "/v1/unload_lora_adapter"
    return [
        Case("health", "GET", "/health"),
        Case("is paused, running", "GET", "/is_paused"),
        Case("pause, bad mode", "POST", "/pause?mode=bogus"),
        Case("pause, default mode", "POST", "/pause"),
        Case("pause, keep", "POST", "/pause?mode=keep"),
        Case("is paused, paused", "GET", "/is_paused"),
        Case("load", "POST", load_path, load("vs-c-v1", adapter)),
        Case("load again, other path", "POST", load_path, load("vs-c-v1", other)),
        Case("load in place", "POST", load_path, load("vs-c-v1", other, load_inplace=True)),
        Case("load, slash", "POST", load_path, load("vs-org/c-v2", adapter)),
        Case("not an adapter", "POST", load_path, load("vs-x", not_adapter)),
        Case("missing dir", "POST", load_path, load("vs-x", missing)),
        Case("empty name", "POST", load_path, load("", adapter)),
        Case("base model's name", "POST", load_path, load(BASE_MODEL, adapter)),
        Case("no path", "POST", load_path, {"lora_name": "vs-x"}),
        Case("bad JSON", "POST", load_path, raw=b"nope", headers=JSON),
        Case("no content type", "POST", load_path, raw=b"{}"),
        Case("list", "GET", "/v1/models"),
        Case("unload unknown", "POST", unload_path, {"lora_name": "vs-nope"}),
        Case("unload, slash", "POST", unload_path, {"lora_name": "vs-org/c-v2"}),
        Case("unload", "POST", unload_path, {"lora_name": "vs-c-v1"}),
        Case("unload again", "POST", unload_path, {"lora_name": "vs-c-v1"}),
        Case("list, after unload", "GET", "/v1/models"),
        Case("resume", "POST", "/resume"),
        Case("resume, running", "POST", "/resume"),
        Case("is paused, resumed", "GET", "/is_paused"),
        Case("unknown path", "GET", "/no/such/path"),
    ]


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    async with SimFleet(["w001"], [1], base_model=BASE_MODEL, engines=["vllm"]) as fleet:
        yield fleet


async def test_simulated_vllm_answers_every_request_like_the_real_one(
    vllm: VllmFleet, sim: SimFleet, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    adapter = write_adapter(tmp_path / "adapters", 1, hidden=128, layers=2)
    other = write_adapter(tmp_path / "adapters", 2, hidden=128, layers=2)
    not_adapter = tmp_path / "notes"
    not_adapter.mkdir()
    (not_adapter / "README.md").write_text("no adapter here\n")
    real_url = vllm.url("w001")
    differences, still_known = [], set()

    try:
        for case in cases(adapter, other, not_adapter, tmp_path / "missing"):
            real = await ask(http, real_url, case, normalize)
            simulated = await ask(http, sim.system_url("w001"), case, normalize)
            if real == simulated:
                continue
            if case.what in KNOWN:
                still_known.add(case.what)
                continue
            differences.append(f"{case.what}:\n  real {real}\n  sim  {simulated}")
    finally:
        await http.post(f"{real_url}/resume")

    assert not differences, "\n".join(differences)
    assert still_known == set(KNOWN), f"no longer different: {sorted(set(KNOWN) - still_known)}"
