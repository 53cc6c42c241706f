"""A serving process waits for its bus: a coordinator, an agent and a tap
started before nats-server keep running and get ready once it listens; a
running fleet rides out nats-server frozen (SIGSTOP) and killed and
restarted; what waiting cannot mend (refused credentials, a link that
would expose the fleet, a certificate this client cannot verify) still ends
the process at once. A wait is said once, then once a minute, never per try.

Real processes and real nats-servers, each test its own, since it breaks them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import msgspec
import nats.errors
import pytest
from processes import Processes, run_lorabus, wait_live_workers
from tenacity import retry_if_exception

from lorabus import BusUnreachable, InsecureConnection, PermissionDenied
from lorabus.agents import AgentConfig
from lorabus.bus.connect import (
    close,
    connect,
    is_transient,
    until_answered,
    wait_connected,
    wait_flushed,
)
from lorabus.bus.options import BusOptions
from lorabus.client import UpdateClient
from lorabus.coordinator import CoordinatorConfig
from lorabus.schemas import Subjects, UpdateResult
from lorabus.security.auth_init import write_fleet_auth
from lorabus.security.roles import Role
from lorabus.service_flags import agent_args, coordinator_args
from lorabus.simfleet import SimFleet
from lorabus.testbed.child_processes import ChildProcess
from lorabus.testbed.natsserver import NatsServer, free_port

WAITING = "waiting for the bus: "
"""The line a process writes once when it starts to wait (later ones say "still")."""
ANSWERS = "done waiting for the bus after"
DEADLINE_S = 60.0
"""Only to fail instead of hanging."""
USER, PASSWORD = "lorabus", "right-horse"


async def _until(condition: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
    try:
        async with asyncio.timeout(deadline_s):
            while True:
                if condition():
                    return
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {deadline_s:.0f}s: {what}") from None


@contextlib.contextmanager
def _nobody_listens(port: int) -> Iterator[None]:
    """Keep ``port`` bound but not listening, so that a connect to it is
    refused and no other test's server takes it meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as placeholder:
        placeholder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        placeholder.bind(("127.0.0.1", port))
        yield


async def _freeze(server: NatsServer) -> None:
    """SIGSTOP nats-server, and wait until every thread of it has stopped
    (the signal lands a moment after it is sent)."""
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)
    tasks = Path(f"/proc/{server.process.pid}/task")

    def stopped() -> bool:
        try:
            stats = [(task / "stat").read_text() for task in tasks.iterdir()]
        except FileNotFoundError:  # a thread that ended meanwhile: look again
            return False
        return all(stat.rpartition(")")[2].split()[0] in ("T", "t") for stat in stats)

    await _until(stopped, "nats-server stops")


def _thaw(server: NatsServer) -> None:
    if server.process is not None:
        server.process.send_signal(signal.SIGCONT)


def _log(child: ChildProcess) -> str:
    return child.log_path.read_text(errors="replace")


async def _until_logged(child: ChildProcess, text: str, *, times: int = 1) -> None:
    def logged() -> bool:
        assert child.running, child.describe()
        return _log(child).count(text) >= times

    await _until(logged, f"{child.name} logs {text!r} {times}x\n{child.describe()}")


async def _bus_connected(metrics_port: int) -> str:
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    found = re.search(r"^lorabus_bus_connected (\S+)$", text, re.MULTILINE)
    assert found, text
    return found.group(1)


async def _committed(client: UpdateClient, path: str, version: int) -> UpdateResult:
    """Ask, and ask again with the same id while nobody could answer yet."""
    async with asyncio.timeout(DEADLINE_S):
        while True:
            result = await client.update(
                "policy", path, version=version, update_id=f"step-{version}", timeout_s=10
            )
            if result.error is None or result.error.code not in (
                "timeout",
                "no_coordinator",
                "not_leader",
                "quorum_not_reached",
            ):
                return result


# -- in one process: the helpers ------------------------------------------------


async def test_a_connection_asked_before_nats_listens_is_made_once_it_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="lorabus.bus.connect")
    port = free_port()
    waiting = asyncio.ensure_future(
        wait_connected(f"nats://127.0.0.1:{port}", name="test", who="test", attempt_s=1)
    )
    try:
        with _nobody_listens(port):
            await _until(lambda: WAITING in caplog.text, "a line saying it waits")
            assert not waiting.done()
        async with NatsServer(port=port):
            async with asyncio.timeout(DEADLINE_S):
                nc = await waiting
            try:
                assert nc.is_connected
            finally:
                await close(nc)
    finally:
        waiting.cancel()
    # Once when it starts to wait, once when the bus answers: never a line per try.
    assert caplog.text.count(WAITING) == 1, caplog.text
    assert caplog.text.count(ANSWERS) == 1, caplog.text


@pytest.mark.looptime
async def test_a_long_wait_is_said_once_then_once_a_minute_never_per_try(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Ten minutes of a bus that does not answer, on the loop's fake clock:
    one line when the waiting starts, one a minute after, one when it ends."""
    caplog.set_level(logging.INFO, logger="lorabus.bus.connect")
    tries = 0

    async def unanswered_for_ten_minutes() -> str:
        nonlocal tries
        tries += 1
        if asyncio.get_running_loop().time() < 600:
            raise nats.errors.TimeoutError
        return "answered"

    answer = await until_answered(
        unanswered_for_ten_minutes,
        who="test",
        doing="asking",
        retry=retry_if_exception(is_transient),
    )

    assert answer == "answered"
    assert tries > 60  # every 10 s at the most
    assert caplog.text.count(WAITING) == 1, caplog.text
    assert 8 <= caplog.text.count("still waiting for the bus after") <= 10, caplog.text
    assert caplog.text.count(ANSWERS) == 1, caplog.text


async def test_a_flush_waits_out_a_frozen_nats_server_on_the_same_link(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The flush times out while the server is frozen, and is tried again; the
    answer to the one that timed out arrives late, and the link takes it in
    its stride (nats-py alone would stop reading, and reconnect much later)."""
    caplog.set_level(logging.INFO, logger="lorabus.bus.connect")
    async with NatsServer() as server:
        nc = await connect(server.url, name="test")
        try:
            await _freeze(server)
            try:
                flushed = asyncio.ensure_future(wait_flushed(nc, who="test"))
                # Past the flush's own deadline: it failed once, and waits.
                await _until(lambda: WAITING in caplog.text, "a line saying it waits")
                assert not flushed.done()
            finally:
                _thaw(server)
            async with asyncio.timeout(DEADLINE_S):
                await flushed
            async with asyncio.timeout(DEADLINE_S):
                await nc.flush(timeout=DEADLINE_S)
            assert nc.stats["reconnects"] == 0
        finally:
            await close(nc)
    assert caplog.text.count(WAITING) == 1, caplog.text
    assert caplog.text.count(ANSWERS) == 1, caplog.text
    assert "encountered error" not in caplog.text, caplog.text


@pytest.fixture
async def guarded_server() -> AsyncIterator[NatsServer]:
    async with NatsServer(options=["--user", USER, "--pass", PASSWORD]) as server:
        yield server


async def test_refused_credentials_are_not_waited_for(guarded_server: NatsServer) -> None:
    url = f"nats://{USER}:wrong@127.0.0.1:{guarded_server.port}"
    async with asyncio.timeout(DEADLINE_S):
        with pytest.raises(PermissionDenied, match="Authorization Violation"):
            await wait_connected(url, name="test")


async def test_a_link_that_would_expose_the_fleet_is_not_waited_for() -> None:
    # No server anywhere: the options are refused before anything is sent.
    async with asyncio.timeout(DEADLINE_S):
        with pytest.raises(InsecureConnection, match="no credentials"):
            await wait_connected("nats://192.0.2.1:4222", name="test")


async def test_a_server_certificate_this_client_cannot_verify_is_not_waited_for(
    tmp_path: Path,
) -> None:
    ours = write_fleet_auth(tmp_path / "ours", Subjects(fleet="f"), ["w000"], tls=True)
    other = write_fleet_auth(tmp_path / "theirs", Subjects(fleet="f"), ["w000"], tls=True)
    options = BusOptions.of_identity(ours.identity(Role.ORCHESTRATOR, None).folder)
    wrong_ca = msgspec.structs.replace(
        options,
        tls_ca_file=BusOptions.of_identity(other.identity(Role.AUDITOR, None).folder).tls_ca_file,
    )
    async with NatsServer(include=ours.server_conf) as server, asyncio.timeout(DEADLINE_S):
        with pytest.raises(BusUnreachable, match="cannot verify the certificate"):
            await wait_connected(f"tls://127.0.0.1:{server.port}", name="test", options=wrong_ca)


# -- real processes ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("nats_at_start", ["absent", "frozen"])
async def test_a_fleet_started_before_nats_answers_waits_for_it_then_serves(
    nats_at_start: str,
    fleet_name: str,
    make_adapter: Callable[[int], str],
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
    tmp_path: Path,
) -> None:
    """No nats-server on the port yet, or one that accepts connections but
    answers nothing (SIGSTOP): the coordinator, an agent and a tap wait. The
    agent resumes the engine its predecessor left paused meanwhile."""
    sim = await start_sim({"w000": 1})
    sim.workers["w000"].paused = True  # a predecessor died with it paused
    server = NatsServer()
    url, metrics_port = server.url, free_port()
    trail = tmp_path / "trail.jsonl"
    try:
        with contextlib.ExitStack() as before_nats:
            if nats_at_start == "frozen":
                await server.start()
                await _freeze(server)
            else:
                before_nats.enter_context(_nobody_listens(server.port))
            coordinator = await processes.start_coordinator(
                CoordinatorConfig(fleet=fleet_name, frontend_url=sim.url, expected_world_size=1),
                nats_url=url,
                extra=["--metrics-port", str(metrics_port)],
            )
            agents = await processes.start_agents(
                {"w000": 1}, sim.system_url, frontend_url=sim.url, fleet=fleet_name, nats_url=url
            )
            tap = await processes.start(
                "tap", ["tap", "--nats", url, "--fleet", fleet_name, "--out", str(trail)]
            )
            parts = [coordinator, agents["w000"], tap]
            for part in parts:
                await _until_logged(part, WAITING)
            assert await _bus_connected(metrics_port) == "0.0"
            assert not sim.workers["w000"].paused, "the engine stays paused while NATS is away"

        if server.process is None:
            await server.start()
        else:
            _thaw(server)
        async with await UpdateClient.connect(url, fleet_name) as client:
            await wait_live_workers(client, {"w000"}, processes=processes, deadline_s=DEADLINE_S)
            assert (await _committed(client, make_adapter(1), 1)).committed
        assert await _bus_connected(metrics_port) == "1.0"
        await _until(lambda: trail.exists() and trail.stat().st_size > 0, "the tap writes")
        processes.check_alive()
    finally:
        _thaw(server)
        server.stop()

    for part in parts:
        text = _log(part)
        assert text.count(WAITING) == 1, part.describe()
        assert ANSWERS in text, part.describe()
        assert "Traceback" not in text, part.describe()


@pytest.mark.slow
async def test_a_running_fleet_rides_out_nats_frozen_then_killed_and_restarted(
    fleet_name: str,
    make_adapter: Callable[[int], str],
    processes: Processes,
    start_sim: Callable[..., Awaitable[SimFleet]],
    tmp_path: Path,
) -> None:
    sim = await start_sim({"w000": 1})
    store = str(tmp_path / "nats-store")
    server = NatsServer(store_dir=store)
    await server.start()
    try:
        coordinator = await processes.start_coordinator(
            CoordinatorConfig(fleet=fleet_name, frontend_url=sim.url, expected_world_size=1),
            nats_url=server.url,
        )
        agents = await processes.start_agents(
            {"w000": 1}, sim.system_url, frontend_url=sim.url, fleet=fleet_name, nats_url=server.url
        )
        tap = await processes.start(
            "tap",
            ["tap", "--nats", server.url, "--fleet", fleet_name, "--out", str(tmp_path / "trail")],
        )
        parts = [coordinator, agents["w000"], tap]
        async with await UpdateClient.connect(server.url, fleet_name) as client:
            await wait_live_workers(client, {"w000"}, processes=processes, deadline_s=DEADLINE_S)
            assert (await _committed(client, make_adapter(1), 1)).committed
        # The tap is connected once it has written the update's records: a tap
        # still starting when the bus freezes would have no connection to lose.
        trail = tmp_path / "trail"
        await _until(
            lambda: trail.exists() and trail.stat().st_size > 0,
            f"the tap writes the trail\n{tap.describe()}",
        )

        # Frozen past every deadline of the coordinator's calls to it (5 s):
        # the coordinator's lease renewal fails.
        await _freeze(server)
        try:
            await _until(
                lambda: (
                    "lease renewal failed" in _log(coordinator)
                    or "stepped down" in _log(coordinator)
                ),
                f"the coordinator notices the frozen bus\n{coordinator.describe()}",
            )
        finally:
            _thaw(server)

        # Killed, and started again on the same port with the same store.
        disconnects = [_log(part).count("disconnected, reconnecting") for part in parts]
        assert server.process is not None
        server.process.kill()
        server.process.wait()
        with _nobody_listens(server.port):
            for part, seen in zip(parts, disconnects, strict=True):
                await _until_logged(part, "disconnected, reconnecting", times=seen + 1)
        server = NatsServer(port=server.port, store_dir=store)
        await server.start()

        async with await UpdateClient.connect(server.url, fleet_name) as client:
            await wait_live_workers(client, {"w000"}, processes=processes, deadline_s=DEADLINE_S)
            assert (await _committed(client, make_adapter(2), 2)).committed
        processes.check_alive()
        for part in parts:
            assert "Traceback" not in _log(part), part.describe()
    finally:
        server.stop()


@pytest.mark.parametrize("part", ["coordinator", "agent", "tap"])
async def test_refused_credentials_end_a_serving_process_at_once(
    part: str,
    guarded_server: NatsServer,
    fleet_name: str,
    start_sim: Callable[..., Awaitable[SimFleet]],
) -> None:
    sim = await start_sim({"w000": 1})
    url = guarded_server.url
    if part == "coordinator":
        config = CoordinatorConfig(fleet=fleet_name, frontend_url=sim.url, expected_world_size=1)
        args = coordinator_args(config, nats_url=url)
    elif part == "agent":
        agent = AgentConfig(
            fleet=fleet_name, worker_id="w000", system_url=sim.system_url("w000"), world_size=1
        )
        args = agent_args(agent, nats_url=url)
    else:
        args = ["tap", "--nats", url, "--fleet", fleet_name]
    finished = await run_lorabus(
        *args, "--nats-user", USER, env={"LORABUS_NATS_PASSWORD": "wrong"}, deadline_s=DEADLINE_S
    )

    assert finished.returncode == 1, finished
    assert "error: authorization violation" in finished.stderr, finished
    assert WAITING not in finished.stderr, finished
    assert "Traceback" not in finished.stderr, finished


def test_a_tls_handshake_cut_short_is_waited_for_a_refused_certificate_is_not() -> None:
    """A server restarting cuts handshakes short (EOF): trying again mends
    that. A TLS alert from the server (no client certificate, a bad one)
    does not."""
    from lorabus.bus.connect import _refusal

    cut_short = ssl.SSLEOFError(8, "EOF occurred in violation of protocol")
    refused = ssl.SSLError(1, "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] certificate required")
    refused.reason = "TLSV13_ALERT_CERTIFICATE_REQUIRED"  # as OpenSSL sets it

    assert _refusal(cut_short, "tls://n1:4222") is None
    assert isinstance(_refusal(refused, "tls://n1:4222"), PermissionDenied)
