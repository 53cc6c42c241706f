"""Connecting to NATS: a refused password and an unreachable server are told
apart, quickly, by name, and no password appears in what is printed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from processes import run_lorabus

from lorabus import BusOptions, BusUnreachable, PermissionDenied
from lorabus.bus.connect import close, connect, redact
from lorabus.testbed.natsserver import NatsServer, free_port

USER, PASSWORD, WRONG = "orchestrator", "right-horse", "wrong-battery"


@pytest.fixture
async def guarded_server() -> AsyncIterator[NatsServer]:
    async with NatsServer(options=["--user", USER, "--pass", PASSWORD]) as server:
        yield server


def _url(server: NatsServer, password: str) -> str:
    return f"nats://{USER}:{password}@127.0.0.1:{server.port}"


async def test_the_right_password_connects(guarded_server: NatsServer) -> None:
    nc = await connect(_url(guarded_server, PASSWORD), name="test")
    try:
        assert nc.is_connected
    finally:
        await close(nc)


async def test_a_wrong_password_is_refused_by_name_at_once(guarded_server: NatsServer) -> None:
    # A long timeout: waiting it out would end in BusUnreachable, and fail.
    with pytest.raises(PermissionDenied, match="Authorization Violation") as refused:
        await connect(_url(guarded_server, WRONG), name="test", connect_timeout_s=60)
    assert WRONG not in str(refused.value)
    assert f"nats://127.0.0.1:{guarded_server.port}" in str(refused.value)


async def test_a_server_that_is_not_there_is_unreachable() -> None:
    url = f"nats://{USER}:{WRONG}@127.0.0.1:{free_port()}"
    with pytest.raises(BusUnreachable, match="cannot reach NATS") as unreachable:
        await connect(url, name="test", connect_timeout_s=1)
    assert WRONG not in str(unreachable.value)


async def test_the_cli_says_the_credentials_were_refused_without_printing_them(
    guarded_server: NatsServer,
) -> None:
    finished = await run_lorabus(
        "status",
        "--nats",
        f"nats://127.0.0.1:{guarded_server.port}",
        "--nats-user",
        USER,
        "--fleet",
        "f",
        env={"LORABUS_NATS_PASSWORD": WRONG},
        deadline_s=30,
    )
    assert finished.returncode == 1, finished
    assert "error: authorization violation" in finished.stderr, finished
    assert "Traceback" not in finished.stderr
    assert WRONG not in finished.stdout + finished.stderr


async def test_a_password_from_the_environment_connects(guarded_server: NatsServer) -> None:
    options = BusOptions(user=USER)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORABUS_NATS_PASSWORD", PASSWORD)
        nc = await connect(f"nats://127.0.0.1:{guarded_server.port}", name="test", options=options)
    await close(nc)


async def test_a_password_in_the_url_works_but_is_warned_about_and_never_printed(
    guarded_server: NatsServer,
) -> None:
    finished = await run_lorabus(
        "status", "--nats", _url(guarded_server, WRONG), "--fleet", "f", deadline_s=30
    )
    assert finished.returncode == 1, finished
    assert "a password in the NATS URL is visible" in finished.stderr
    assert WRONG not in finished.stdout + finished.stderr


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://u:p@host:4222", "nats://host:4222"),
        ("tls://u@host", "tls://host"),
        ("u:p@a:1,nats://b:2", "a:1,nats://b:2"),
        ("nats://host:4222", "nats://host:4222"),
    ],
)
def test_urls_are_printed_without_their_user_and_password(url: str, shown: str) -> None:
    assert redact(url) == shown


@pytest.mark.parametrize("bad", ["localhost:abc", "http://localhost:4222", "nats://"])
async def test_a_malformed_nats_url_is_a_usage_error_not_a_traceback(bad: str) -> None:
    finished = await run_lorabus("status", "--nats", bad, "--fleet", "f")

    assert finished.returncode == 2, finished
    assert "Invalid value for '--nats'" in finished.stderr and bad in finished.stderr
    assert "Traceback" not in finished.stderr


async def test_update_json_against_an_unreachable_bus_prints_its_error_as_json() -> None:
    """--timeout covers connecting too: a 2 s timeout against a port nobody
    listens on ends with the bus_unreachable result, as one JSON object."""
    url = f"nats://127.0.0.1:{free_port()}"
    finished = await run_lorabus(
        "update", "--nats", url, "--fleet", "f", "--adapter", "a", "--path", "/a/1",
        "--json", "--timeout", "2", "--update-id", "step-1",
    )  # fmt: skip

    assert finished.returncode == 1, finished
    result = json.loads(finished.stdout)
    assert (result["update_id"], result["status"]) == ("step-1", "failed")
    assert result["error"]["code"] == "bus_unreachable"
    assert "within 2s" in result["error"]["message"]
