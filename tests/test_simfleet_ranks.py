"""A simulated vLLM with data parallelism holds adapters per rank and names per API server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from adapter_dirs import write_adapter

from lorabus.simfleet import EngineSetup, SimFleet, WorkerFaults

CANARY = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
LOAD = "/workers/v/v1/load_lora_adapter"
COMPLETIONS = "/workers/v/v1/completions"


@pytest.fixture
async def fleet() -> AsyncIterator[SimFleet]:
    """One vLLM worker ``v`` of world size 2 (TP*PP), data-parallel over 2 ranks."""
    async with SimFleet(["v"], [2], engines=("vllm",)) as started:
        started.workers["v"].set_setup(data_parallel_size=2)
        yield started


@pytest.fixture
async def http(fleet: SimFleet) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=fleet.url, timeout=10) as client:
        yield client


@pytest.fixture
def adapter(tmp_path: Path) -> str:
    return str(write_adapter(tmp_path / "a"))


async def complete(http: httpx.AsyncClient, model: str, rank: str | None = None) -> httpx.Response:
    headers = {} if rank is None else {"X-data-parallel-rank": rank}
    return await http.post(COMPLETIONS, json={**CANARY, "model": model}, headers=headers)


def text(reply: httpx.Response) -> str:
    return reply.json()["choices"][0]["text"]


def not_found(model: str) -> dict[str, object]:
    message = f"The model `{model}` does not exist."
    return {"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}}


async def test_a_load_reaches_every_rank_and_each_answers_naming_itself(
    http: httpx.AsyncClient, adapter: str
) -> None:
    loaded = await http.post(LOAD, json={"lora_name": "a", "lora_path": adapter})

    replies = [await complete(http, "a", rank) for rank in ("0", "1")]

    assert loaded.status_code == 200
    assert [r.status_code for r in replies] == [200, 200]
    assert [text(r) for r in replies] == [
        "simulated reply from worker v rank 0 using model a",
        "simulated reply from worker v rank 1 using model a",
    ]


async def test_a_rank_the_load_missed_answers_the_model_does_not_exist(
    fleet: SimFleet, http: httpx.AsyncClient, adapter: str
) -> None:
    faults = await http.put("/sim/workers/v/faults", json={"load_misses_ranks": [1]})
    loaded = await http.post(LOAD, json={"lora_name": "a", "lora_path": adapter})

    on_0, on_1 = await complete(http, "a", "0"), await complete(http, "a", "1")
    base_on_1 = await complete(http, "sim-base", "1")

    assert faults.json()["faults"]["load_misses_ranks"] == [1]
    assert loaded.status_code == 200
    assert fleet.workers["v"].ranks_holding("a") == {0}
    assert on_0.status_code == 200
    assert (on_1.status_code, on_1.json()) == (404, not_found("a"))
    assert base_on_1.status_code == 200


async def test_without_a_rank_header_completions_take_each_rank_in_turn(
    http: httpx.AsyncClient,
) -> None:
    replies = [await complete(http, "sim-base") for _ in range(3)]

    assert [text(r).split(" using")[0] for r in replies] == [
        "simulated reply from worker v rank 0",
        "simulated reply from worker v rank 1",
        "simulated reply from worker v rank 0",
    ]


async def test_a_rank_out_of_range_is_a_400_and_a_rank_that_is_no_integer_is_ignored(
    http: httpx.AsyncClient,
) -> None:
    out_of_range = await complete(http, "sim-base", "2")
    negative = await complete(http, "sim-base", "-1")
    ignored = await complete(http, "sim-base", "first")

    assert (out_of_range.status_code, out_of_range.json()) == (
        400,
        {
            "error": {
                "message": "data_parallel_rank 2 is out of range [0, 2).",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        },
    )
    assert negative.json()["error"]["message"] == "data_parallel_rank -1 is out of range [0, 2)."
    assert ignored.status_code == 200


async def test_an_unload_leaves_no_rank_holding_the_adapter(
    fleet: SimFleet, http: httpx.AsyncClient, adapter: str
) -> None:
    await http.post(LOAD, json={"lora_name": "a", "lora_path": adapter})

    unloaded = await http.post("/workers/v/v1/unload_lora_adapter", json={"lora_name": "a"})
    replies = [await complete(http, "a", rank) for rank in ("0", "1")]

    assert unloaded.status_code == 200
    assert [r.status_code for r in replies] == [404, 404]
    assert fleet.workers["v"].adapters == {}


async def test_the_world_size_counts_the_ranks_unless_asked_without(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    fleet.workers["v"].set_setup(data_parallel_size=3)

    default = await http.get("/workers/v/get_world_size")
    with_dp = await http.get("/workers/v/get_world_size", params={"include_dp": "true"})
    without = await http.get("/workers/v/get_world_size", params={"include_dp": "false"})
    bad = await http.get("/workers/v/get_world_size", params={"include_dp": "maybe"})

    assert default.json() == with_dp.json() == {"world_size": 6}
    assert without.json() == {"world_size": 2}
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "query.include_dp"


async def test_the_server_info_shows_the_parallel_config_as_json_or_text(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    fleet.workers["v"].set_setup(api_server_count=2)

    as_json = await http.get("/workers/v/server_info", params={"config_format": "json"})
    as_text = await http.get("/workers/v/server_info")

    assert as_json.status_code == 200
    body = as_json.json()
    assert (body["vllm_env"], body["system_env"]) == ({}, {})
    parallel = body["vllm_config"]["parallel_config"]
    assert {
        key: parallel[key]
        for key in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "data_parallel_size_local",
            "data_parallel_rank",
            "data_parallel_external_lb",
            "data_parallel_hybrid_lb",
            "_api_process_count",
            "_api_process_rank",
        )
    } == {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 2,
        "data_parallel_size_local": 2,
        "data_parallel_rank": 0,
        "data_parallel_external_lb": False,
        "data_parallel_hybrid_lb": False,
        "_api_process_count": 2,
        "_api_process_rank": 0,
    }
    config = as_text.json()["vllm_config"]
    assert isinstance(config, str)
    assert "data_parallel_size=2" in config


async def test_the_dev_routes_are_unknown_without_dev_mode(
    fleet: SimFleet, http: httpx.AsyncClient
) -> None:
    fleet.workers["v"].set_setup(dev_mode=False)

    replies = [await http.get(f"/workers/v/{path}") for path in ("get_world_size", "server_info")]

    assert [(r.status_code, r.json()) for r in replies] == [(404, {"detail": "Not Found"})] * 2


async def test_with_two_api_servers_a_load_registers_in_the_one_that_answered(
    fleet: SimFleet, http: httpx.AsyncClient, adapter: str
) -> None:
    fleet.workers["v"].set_setup(api_server_count=2)
    loaded = await http.post(LOAD, json={"lora_name": "a", "lora_path": adapter})  # server 0

    first, second = await complete(http, "a", "0"), await complete(http, "a", "0")
    listed = [
        [card["id"] for card in (await http.get("/workers/v/v1/models")).json()["data"]]
        for _ in range(2)
    ]

    assert loaded.status_code == 200
    assert sorted([first.status_code, second.status_code]) == [200, 404]
    assert (first.status_code, first.json()) == (404, not_found("a"))  # server 1
    assert sorted(listed) == [["sim-base"], ["sim-base", "a"]]


async def test_with_two_api_servers_a_load_and_an_unload_go_to_the_next_one(
    fleet: SimFleet, http: httpx.AsyncClient, adapter: str
) -> None:
    worker = fleet.workers["v"]
    worker.set_setup(api_server_count=2)
    body = {"lora_name": "a", "lora_path": adapter}

    loads = [await http.post(LOAD, json=body) for _ in range(3)]  # servers 0, 1, 0
    known_by = worker.api_servers_knowing("a")
    unloads = [
        await http.post("/workers/v/v1/unload_lora_adapter", json={"lora_name": "a"})
        for _ in range(3)  # servers 1, 0, 1
    ]

    assert [r.status_code for r in loads] == [200, 200, 400]
    assert "has already been loaded" in loads[2].json()["error"]["message"]
    assert known_by == {0, 1}
    assert [r.status_code for r in unloads] == [200, 200, 404]
    assert worker.adapters == {}


async def test_an_unload_through_one_api_server_leaves_the_others_name_without_an_adapter(
    fleet: SimFleet, http: httpx.AsyncClient, adapter: str
) -> None:
    worker = fleet.workers["v"]
    worker.set_setup(api_server_count=2)
    body = {"lora_name": "a", "lora_path": adapter}
    for _ in range(2):
        await http.post(LOAD, json=body)  # servers 0 and 1

    unloaded = await http.post("/workers/v/v1/unload_lora_adapter", json={"lora_name": "a"})
    through_1 = await complete(http, "a", "0")  # server 1 still knows the name

    assert unloaded.status_code == 200  # server 0
    assert worker.api_servers_knowing("a") == {1}
    assert worker.ranks_holding("a") == frozenset()
    assert (through_1.status_code, through_1.json()) == (404, not_found("a"))


async def test_a_worker_without_data_parallelism_answers_as_before(adapter: str) -> None:
    async with (
        SimFleet(["v"], [1], engines=("vllm",)) as fleet,
        httpx.AsyncClient(base_url=fleet.url, timeout=10) as http,
    ):
        await http.post(LOAD, json={"lora_name": "a", "lora_path": adapter})
        replies = [await complete(http, "a") for _ in range(2)]
        on_0 = await complete(http, "a", "0")
        on_1 = await complete(http, "a", "1")
        world = await http.get("/workers/v/get_world_size")
        listed = (await http.get("/workers/v/v1/models")).json()["data"]

    assert [text(r) for r in replies] == ["simulated reply from worker v using model a"] * 2
    assert on_0.status_code == 200
    assert on_1.json()["error"]["message"] == "data_parallel_rank 1 is out of range [0, 1)."
    assert world.json() == {"world_size": 1}
    assert [card["id"] for card in listed] == ["sim-base", "a"]
    assert fleet.workers["v"].adapter_ranks == fleet.workers["v"].adapter_api_servers == {}


@pytest.mark.parametrize("field", ["data_parallel_size", "api_server_count"])
def test_the_engine_setup_refuses_fewer_than_one(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineSetup(**{field: 0})


@pytest.mark.parametrize("ranks", [[-1], [True], ["1"]])
def test_the_faults_refuse_what_is_no_rank(ranks: list[object]) -> None:
    with pytest.raises(ValueError, match="load_misses_ranks"):
        WorkerFaults(load_misses_ranks=ranks)  # type: ignore[arg-type]


@pytest.mark.parametrize("ranks", [[-1], [1.5], "1"])
async def test_the_control_api_refuses_what_is_no_rank(
    fleet: SimFleet, http: httpx.AsyncClient, ranks: object
) -> None:
    reply = await http.put("/sim/workers/v/faults", json={"load_misses_ranks": ranks})

    assert reply.status_code == 400
    assert fleet.workers["v"].faults.load_misses_ranks == []
