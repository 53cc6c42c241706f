"""Retiring is per adapter: a commit's notice retires only its own adapter's
versions that it neither commits nor keeps, so with two adapters committed
in turn (each with a keep of its own) no engine ever unloads a committed or
kept version of either, and each notice names its adapter and what it keeps.

Against a real nats-server, the simulated HTTP engines, a real agent per
worker and the real coordinator (``--keep 2``); the notices are read off the
fleet's command subject.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from nats.aio.msg import Msg

from lorabus.bus.connect import close, connect
from lorabus.schemas import CommittedNotice, Subjects, command_decoder
from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 15.0
STEPS = [
    ("policy", 1, None),
    ("critic", 1, None),
    ("policy", 2, None),
    ("critic", 2, 3),
    ("policy", 3, None),
    ("critic", 3, 3),
    ("policy", 4, 1),
    ("critic", 4, 3),
]
"""(adapter, version, keep) in the order requested; None: the coordinator's."""


async def test_interleaved_commits_of_two_adapters_never_retire_the_others_versions(
    nats_url: str,
    fleet_name: str,
    make_stack: Callable[..., EmbeddedStack],
    make_adapter: Callable[[int], str],
) -> None:
    notices: asyncio.Queue[CommittedNotice] = asyncio.Queue()

    async def on_command(msg: Msg) -> None:
        command = command_decoder.decode(msg.data)
        if isinstance(command, CommittedNotice):
            notices.put_nowait(command)

    served: dict[str, set[str]] = {}
    """Each adapter's committed and kept served names, after each commit."""
    retired: set[str] = set()
    async with make_stack([1, 1], keep=2) as stack:
        assert stack.client is not None and stack.sim is not None
        workers = list(stack.sim.workers.values())
        nc = await connect(nats_url, name="test-notice-listener")
        try:
            await nc.subscribe(Subjects(fleet=fleet_name).cmd(), cb=on_command)
            await nc.flush()
            for step, (adapter, version, keep) in enumerate(STEPS):
                path = make_adapter(step)
                result = await stack.client.update(adapter, path, version=version, keep=keep)
                assert result.committed, result.error
                notice = await asyncio.wait_for(notices.get(), DEADLINE_S)
                assert (notice.adapter, notice.served_name) == (adapter, result.adapter)
                served[adapter] = {notice.served_name, *(k.served_name for k in notice.kept)}
                every = set().union(*served.values())
                assert not set(notice.retire) & every, (notice.retire, every)
                assert all(name.startswith(f"{adapter}-v") for name in notice.retire)
                retired |= set(notice.retire)
                # Retiring runs after the answer: wait until it has.
                async with asyncio.timeout(DEADLINE_S):
                    for worker in workers:
                        await worker.wait_until(lambda w=worker, e=every: set(w.adapters) == e)
        finally:
            await close(nc)
        held = {w.worker_id: set(w.adapters) for w in workers}
        unloaded = {
            r.path.removeprefix("/v1/loras/")
            for w in workers
            for r in w.requests
            if r.method == "DELETE"
        }

    assert served == {"policy": {"policy-v4"}, "critic": {"critic-v4", "critic-v3", "critic-v2"}}
    final = {"policy-v4", "critic-v4", "critic-v3", "critic-v2"}
    assert held == {"w000": final, "w001": final}
    # Every unload was of a name some notice retired: none of another adapter's.
    assert unloaded == retired == {"policy-v1", "policy-v2", "policy-v3", "critic-v1"}
