"""The serving processes' event loop: uvloop by default, asyncio on request,
and a clear usage error for anything else."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import uvloop
from click.testing import CliRunner

from lorabus.cli.main import main
from lorabus.runtime.event_loop import EVENT_LOOP_ENV, running_loop_name, serving_loop_factory


def test_uvloop_by_default_and_asyncio_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    assert serving_loop_factory() is uvloop.new_event_loop
    monkeypatch.setenv(EVENT_LOOP_ENV, "asyncio")
    assert serving_loop_factory() is None
    monkeypatch.setenv(EVENT_LOOP_ENV, "trio")
    with pytest.raises(ValueError, match="must be one of uvloop, asyncio, not 'trio'"):
        serving_loop_factory()


def test_the_running_loop_is_named() -> None:
    async def name() -> str:
        return running_loop_name()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(name()) == "uvloop"
    assert asyncio.run(name()) == "asyncio"


def test_a_serving_command_refuses_an_unknown_loop_before_connecting() -> None:
    result = CliRunner().invoke(
        main,
        [
            *("agent", "--nats", "nats://127.0.0.1:1", "--fleet", "f", "--worker-id", "w000"),
            *("--system-url", "http://127.0.0.1:9"),
        ],
        env={EVENT_LOOP_ENV: "trio"},
    )
    assert result.exit_code == 2, result.output
    assert f"{EVENT_LOOP_ENV} must be one of uvloop, asyncio" in result.output


def test_a_settled_collector_leaves_what_exists_out_of_every_collection() -> None:
    # In a process of its own: freezing this one would keep the test session's
    # garbage for good.
    probe = (
        "import gc; from lorabus.runtime.event_loop import settle_collector\n"
        "before = gc.get_freeze_count(); settle_collector()\n"
        "print(before, gc.get_freeze_count(), gc.get_threshold()[0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()

    before, frozen, young = (int(field) for field in out)
    assert before == 0 and frozen > 10_000  # the imports, at least
    assert young > 700  # CPython's default: a pass every 700 net allocations
