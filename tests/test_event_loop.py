"""The serving processes' event loop: uvloop by default, asyncio on request,
and a clear usage error for anything else."""

from __future__ import annotations

import asyncio

import pytest
import uvloop
from click.testing import CliRunner

from lorabus.cli.main import main
from lorabus.event_loop import EVENT_LOOP_ENV, running_loop_name, serving_loop_factory


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
