"""A coordinator that is stopped answers everyone still waiting for a result,
and a requester that is interrupted says which update runs on."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable

from hand_coordinator import write_leader
from processes import Processes

from lorabus.bus.connect import close, connect
from lorabus.client import UpdateClient
from lorabus.coordinator import Coordinator, CoordinatorConfig
from lorabus.schemas import Subjects


@contextlib.asynccontextmanager
async def _waiting_coordinator(
    nats_url: str, fleet_name: str
) -> AsyncIterator[tuple[Coordinator, asyncio.Task[None]]]:
    """A coordinator of a fleet whose quorum never comes: an update it takes
    runs (waiting) until the test is done. Yields it and its serving task."""
    coordinator = Coordinator(
        CoordinatorConfig(
            fleet=fleet_name,
            frontend_url="http://127.0.0.1:9",
            expected_world_size=4,
            quorum_timeout_s=60,
        )
    )
    nc = await connect(nats_url, name="test-coordinator")
    ready = asyncio.Event()
    serving = asyncio.create_task(coordinator.run(nc, ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        yield coordinator, serving
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await close(nc)


class _StopWhenLeadingEnds(asyncio.Event):
    """The coordinator's leading flag, which stops the coordinator (as a
    SIGTERM would) at the moment a term ends: while it steps down."""

    stop: Callable[[], object] | None = None

    def clear(self) -> None:
        super().clear()
        if self.stop is not None:
            self.stop()


async def test_a_stop_that_comes_while_the_coordinator_steps_down_stops_it(
    nats_url: str, fleet_name: str
) -> None:
    coordinator = Coordinator(
        CoordinatorConfig(
            fleet=fleet_name,
            frontend_url="http://127.0.0.1:9",
            expected_world_size=1,
            leader_lease_s=1.0,
        )
    )
    leading = coordinator.leading = _StopWhenLeadingEnds()
    nc = await connect(nats_url, name="test-coordinator")
    serving = asyncio.create_task(coordinator.run(nc))
    try:
        async with asyncio.timeout(10):
            await leading.wait()
        leading.stop = serving.cancel
        # Another holder takes the lease: the next renewal steps the term down.
        await write_leader(nc, Subjects(fleet=fleet_name), epoch=coordinator.epoch + 1)
        done, _ = await asyncio.wait({serving}, timeout=10)
        assert done, "a coordinator stopped while stepping down went on to campaign again"
        assert serving.cancelled()
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await close(nc)


async def test_a_stopped_coordinator_answers_pending_requests_instead_of_dropping_them(
    nats_url: str, fleet_name: str
) -> None:
    client_nc = await connect(nats_url, name="test-client")
    try:
        async with _waiting_coordinator(nats_url, fleet_name) as (coordinator, serving):
            client = UpdateClient(client_nc, fleet_name)
            # With no other coordinator, the client asks again until its timeout,
            # then answers with what the stopped one said.
            running = asyncio.create_task(
                client.update("policy", "/a/step_1", version=1, timeout_s=3)
            )
            queued = asyncio.create_task(
                client.update("other", "/a/step_2", version=2, timeout_s=3)
            )
            await asyncio.wait_for(_until_running(coordinator), 10)
            serving.cancel()
            results = await asyncio.wait_for(asyncio.gather(running, queued), 10)
    finally:
        await close(client_nc)

    for result in results:
        assert result.status == "failed"
        assert result.error is not None
        assert "coordinator stopped" in result.error.message


async def test_an_interrupted_update_says_which_update_runs_on_and_how_to_fetch_it(
    nats_url: str, fleet_name: str, processes: Processes
) -> None:
    async with _waiting_coordinator(nats_url, fleet_name) as (coordinator, _):
        update = await processes.start(
            "update",
            ["update", "--nats", nats_url, "--fleet", fleet_name, "--adapter", "policy",
             "--path", "/a/step_1", "--version", "1", "--update-id", "step-1"],
        )  # fmt: skip
        await asyncio.wait_for(_until_running(coordinator), 10)
        update.ended_on_purpose = True
        update.process.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(update.process.wait(), 10)

    assert code == 130, update.describe()
    said = update.log_tail(50)
    assert "interrupted: update step-1 may still run" in said, said
    assert "lorabus result step-1" in said, said


async def _until_running(coordinator: Coordinator) -> None:
    """Poll until an update is in flight (it then waits for a quorum that never comes).

    The book has no event for "taken from the queue", and the test must not add
    one to the product just to be woken: a bounded poll of its state will do.
    """
    while coordinator.book.running is None:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
