"""The simulated worker answers like a real Dynamo 1.6.1 worker, request for request.

The same sequence of system-server requests goes to a real worker (a fleet
of this test's own, so no other test's adapters show) and to a simulated one;
status codes, content types and bodies must match. Adapter ids are left out
(Dynamo hashes names with blake3, the simulator with sha256), and where the
text comes from the inference engine rather than from Dynamo (what vLLM says
about a directory that is not an adapter, serde's wording of a bad body) only
Dynamo's own prefix is compared.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_answers import Case, ask
from real_fleet import DynamoFleet

from lorabus.simfleet import SimFleet

pytestmark = pytest.mark.real_dynamo

JSON = {"content-type": "application/json"}


def normalize(body: Any, case: Case) -> Any:
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if case.only is None or k in case.only}
        if "lora_id" in body:
            body["lora_id"] = "<id>"
        if isinstance(body.get("loras"), dict):
            body["loras"] = dict.fromkeys(body["loras"], "<id>")
        if case.prefix is not None and isinstance(body.get("message"), str):
            body["message"] = body["message"][: case.prefix]
        return body
    if isinstance(body, str) and case.prefix is not None:
        return body[: case.prefix]
    return body


def cases(adapter: Path, not_adapter: Path, missing: Path) -> list[Case]:
    good, bad = {"uri": adapter.as_uri()}, {"uri": not_adapter.as_uri()}
    gone = {"uri": missing.as_uri()}
    return [
        Case("health", "GET", "/health", only=("status",)),
        Case("pause", "POST", "/engine/pause_generation", {"mode": "keep", "clear_cache": False}),
        Case("pause, bad mode", "POST", "/engine/pause_generation", {"mode": "bogus"}),
        Case(
            "pause, bad JSON",
            "POST",
            "/engine/pause_generation",
            raw=b"nope",
            headers=JSON,
            prefix=0,
        ),
        Case("load", "POST", "/v1/loras", {"lora_name": "c-v1", "source": good}),
        Case("load again", "POST", "/v1/loras", {"lora_name": "c-v1", "source": gone}),
        Case("load, slash", "POST", "/v1/loras", {"lora_name": "org/c-v2", "source": good}),
        Case("not an adapter", "POST", "/v1/loras", {"lora_name": "x", "source": bad}, prefix=24),
        Case("missing dir", "POST", "/v1/loras", {"lora_name": "x", "source": gone}),
        Case(
            "other scheme", "POST", "/v1/loras", {"lora_name": "x", "source": {"uri": "gs://b/a"}}
        ),
        Case("empty name", "POST", "/v1/loras", {"lora_name": "", "source": good}),
        Case("no source", "POST", "/v1/loras", {"lora_name": "x"}, prefix=58),
        Case("bad JSON", "POST", "/v1/loras", raw=b"nope", headers=JSON, prefix=41),
        Case("no content type", "POST", "/v1/loras", raw=b"{}"),
        Case("list", "GET", "/v1/loras"),
        Case("unload unknown", "DELETE", "/v1/loras/nope"),
        Case("unload, slash", "DELETE", "/v1/loras/org/c-v2"),
        Case("resume", "POST", "/engine/resume_generation", {}),
        Case("unknown engine route", "POST", "/engine/no_such_route", {}),
        Case("unknown path", "GET", "/no/such/path"),
    ]


@pytest.fixture
async def sim() -> AsyncIterator[SimFleet]:
    async with SimFleet(["w000"], [1]) as fleet:
        yield fleet


async def test_simulated_worker_answers_every_request_like_the_real_one(
    make_dynamo_fleet: Callable[[Mapping[str, Mapping[str, str]]], DynamoFleet],
    sim: SimFleet,
    http: httpx.AsyncClient,
    make_adapter: Callable[[int], str],
    tmp_path: Path,
) -> None:
    dynamo = make_dynamo_fleet({})
    adapter = Path(make_adapter(1))
    not_adapter = tmp_path / "notes"
    not_adapter.mkdir()
    (not_adapter / "README.md").write_text("no adapter here\n")
    differences = []

    for case in cases(adapter, not_adapter, tmp_path / "missing"):
        real = await ask(http, dynamo.system_url("w000"), case, normalize)
        simulated = await ask(http, sim.system_url("w000"), case, normalize)
        if real != simulated:
            differences.append(
                f"{case.what}: real {real}\n{' ' * len(case.what)}  sim  {simulated}"
            )

    assert not differences, "\n".join(differences)
