"""The ``lorabus`` CLI as an operator runs it: output, JSON shapes and exit codes.

A whole fleet (simulated workers, agents, coordinator) runs in this process on
the shared nats-server; the CLI runs as a real process against it. Exit codes:
0 committed, 1 failed, 2 bad usage.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from processes import run_lorabus

from lorabus.schemas import ErrorCode
from lorabus.testbed.stack import EmbeddedStack

WORLD_SIZES = [2, 1]
MESSAGE_TAGS = {
    "pause",
    "load",
    "resume",
    "unload",
    "ack",
    "heartbeat",
    "update_request",
    "update_result",
}


@pytest.fixture
async def stack(make_stack: Callable[..., EmbeddedStack]) -> AsyncIterator[EmbeddedStack]:
    async with make_stack(
        WORLD_SIZES,
        phase_timeout_s=10,
        verify_timeout_s=10,
        quorum_timeout_s=10,
    ) as started:
        yield started


def _update_args(nats_url: str, fleet: str, path: str, *extra: str) -> list[str]:
    return [
        "update",
        "--nats",
        nats_url,
        "--fleet",
        fleet,
        "--adapter",
        "policy",
        "--path",
        path,
        *extra,
    ]


def _one_json_object(stdout: str) -> dict[str, Any]:
    lines = stdout.splitlines()
    assert len(lines) == 1, stdout
    parsed = json.loads(lines[0])
    assert isinstance(parsed, dict), parsed
    return parsed


def _tags(schema: Any) -> Iterator[str]:
    """Every ``type`` tag a message struct of the schema is sent with."""
    for definition in schema.get("$defs", {}).values():
        tag = definition.get("properties", {}).get("type", {})
        yield from tag.get("enum", [])
        if "const" in tag:
            yield tag["const"]


async def test_update_json_prints_one_committed_result_and_exits_0(
    stack: EmbeddedStack, make_adapter: Callable[[int], str]
) -> None:
    done = await run_lorabus(
        *_update_args(stack.nats_url, stack.fleet_name, make_adapter(1), "--version", "1", "--json")
    )

    assert done.returncode == 0, done
    result = _one_json_object(done.stdout)
    assert result["status"] == "committed"
    assert result["update_id"]
    assert result["adapter"] == "policy-v1"
    assert result["version"] == 1
    assert result["rank_map"]["world_size"] == 1 + sum(WORLD_SIZES)
    assert [
        (e["worker_id"], e["world_size"], e["rank_offset"]) for e in result["rank_map"]["entries"]
    ] == [("w000", 2, 1), ("w001", 1, 3)]
    assert {"pause", "load", "verify", "resume"} <= set(result["phases"])
    assert {
        worker_id: (outcome["ok"], outcome["error"])
        for worker_id, outcome in result["workers"].items()
    } == {"w000": (True, None), "w001": (True, None)}


async def test_update_of_a_directory_without_adapter_files_exits_1_naming_the_file(
    stack: EmbeddedStack, tmp_path: Path
) -> None:
    empty = tmp_path / "not-an-adapter"
    empty.mkdir()

    done = await run_lorabus(
        *_update_args(stack.nats_url, stack.fleet_name, str(empty), "--version", "1", "--json")
    )

    assert done.returncode == 1, done
    result = _one_json_object(done.stdout)
    assert result["status"] == "failed"
    assert result["error"]["code"] == ErrorCode.WORKER_FAILED
    assert "adapter_config.json" in result["error"]["message"], result["error"]
    assert str(empty) in result["error"]["message"], result["error"]


async def test_update_without_adapter_is_a_usage_error(nats_url: str, fleet_name: str) -> None:
    done = await run_lorabus(
        "update", "--nats", nats_url, "--fleet", fleet_name, "--path", "/ckpt/step_1"
    )

    assert done.returncode == 2, done
    assert "--adapter" in done.stderr


@pytest.mark.parametrize(
    ("command", "missing"),
    [
        (["agent", "--fleet", "f", "--worker-id", "w000"], "--system-url"),
        (["agent", "--fleet", "f", "--system-url", "http://127.0.0.1:9"], "--worker-id"),
        (["coordinator", "--fleet", "f", "--expected-world-size", "2"], "--frontend-url"),
        (["coordinator", "--fleet", "f", "--frontend-url", "http://x"], "--expected-world-size"),
    ],
)
async def test_a_serving_command_without_a_required_option_is_a_usage_error(
    nats_url: str, command: list[str], missing: str
) -> None:
    done = await run_lorabus(command[0], "--nats", nats_url, *command[1:])

    assert done.returncode == 2, done
    assert f"Missing option '{missing}'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


async def test_fleet_name_with_a_dot_is_a_usage_error(nats_url: str) -> None:
    done = await run_lorabus(*_update_args(nats_url, "prod.eu", "/ckpt/step_1"))

    assert done.returncode == 2, done
    assert "prod.eu" in done.stderr


async def test_status_json_shows_members_rank_offsets_and_the_committed_version(
    stack: EmbeddedStack, make_adapter: Callable[[int], str]
) -> None:
    assert stack.client is not None
    assert (await stack.client.update("policy", make_adapter(3), version=3)).committed

    done = await run_lorabus(
        "status", "--nats", stack.nats_url, "--fleet", stack.fleet_name, "--json"
    )

    assert done.returncode == 0, done
    status = _one_json_object(done.stdout)
    assert [
        (m["worker_id"], m["world_size"], m["rank_offset"], m["paused"]) for m in status["members"]
    ] == [("w000", 2, 1, False), ("w001", 1, 3, False)]
    assert status["committed_version"] == 3
    assert status["committed_adapter"] == "policy-v3"


async def test_schema_is_json_naming_every_message_tag() -> None:
    done = await run_lorabus("schema")

    assert done.returncode == 0, done
    assert MESSAGE_TAGS <= set(_tags(json.loads(done.stdout)))


async def test_nats_url_can_come_from_the_environment(stack: EmbeddedStack) -> None:
    done = await run_lorabus(
        "status", "--fleet", stack.fleet_name, "--json", env={"LORABUS_NATS_URL": stack.nats_url}
    )

    assert done.returncode == 0, done
    assert _one_json_object(done.stdout)["fleet"] == stack.fleet_name


async def test_adapter_push_prints_the_digest_and_update_by_digest_commits(
    stack: EmbeddedStack, make_adapter: Callable[[int], str]
) -> None:
    """The trainer side with no filesystem shared with the workers: push, then
    an update that names what was pushed; and the same with --source."""
    from lorabus.adapters.digest import adapter_digest

    source = make_adapter(1)
    bus = ["--nats", stack.nats_url, "--fleet", stack.fleet_name]
    pushed = await run_lorabus("adapter", "push", *bus, source)
    digest = pushed.stdout.strip()
    by_digest = await run_lorabus(
        "update", *bus, "--adapter", "policy", "--digest", digest, "--version", "1", "--json"
    )
    by_source = await run_lorabus(
        "update", *bus, "--adapter", "policy", "--source", make_adapter(2), "--json"
    )

    assert pushed.returncode == 0, pushed
    assert digest == adapter_digest(source)
    assert by_digest.returncode == 0, by_digest
    assert _one_json_object(by_digest.stdout)["path"] == f"bus:{digest}"
    assert by_source.returncode == 0, by_source
    assert _one_json_object(by_source.stdout)["version"] == 2


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ([], "--source DIR"),
        (["--path", "/ckpt/step_1", "--source", "."], "not both"),
    ],
    ids=["no source", "path and source"],
)
async def test_update_names_exactly_one_source(
    nats_url: str, fleet_name: str, extra: list[str], said: str
) -> None:
    done = await run_lorabus(
        "update", "--nats", nats_url, "--fleet", fleet_name, "--adapter", "policy", *extra
    )

    assert done.returncode == 2, done
    assert said in done.stderr


async def test_adapter_push_of_a_directory_that_is_no_adapter_exits_1(
    stack: EmbeddedStack, tmp_path: Path
) -> None:
    done = await run_lorabus(
        "adapter", "push", "--nats", stack.nats_url, "--fleet", stack.fleet_name, str(tmp_path)
    )

    assert done.returncode == 1, done
    assert "adapter_config.json" in done.stderr, done.stderr


async def test_an_agent_whose_cache_cannot_be_written_says_so_and_exits(
    nats_url: str, fleet_name: str, tmp_path: Path
) -> None:
    """Checked at start, not at its first update: a file where the cache
    should be (root, as these tests may run, writes anywhere else)."""
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    done = await run_lorabus(
        "agent",
        "--nats",
        nats_url,
        "--fleet",
        fleet_name,
        "--worker-id",
        "w000",
        "--system-url",
        "http://127.0.0.1:9",
        "--cache-dir",
        str(blocked / "cache"),
    )

    assert done.returncode == 1, done
    assert "--cache-dir" in done.stderr and str(blocked) in done.stderr, done.stderr
