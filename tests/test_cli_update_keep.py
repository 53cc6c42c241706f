"""``lorabus update --keep N`` asks for the adapter's keep: the engines keep
serving its N newest versions, whatever the coordinator's ``--keep``; a keep
outside 1 to 64 is a usage error, sent nowhere.

A whole fleet (simulated workers, agents, a coordinator with ``--keep 1``)
runs in this process; the CLI runs as a real process against it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
from processes import run_lorabus

from lorabus.testbed.stack import EmbeddedStack

DEADLINE_S = 15.0


async def test_update_keep_makes_engines_keep_that_many_versions(
    make_stack: Callable[..., EmbeddedStack], make_adapter: Callable[[int], str]
) -> None:
    async with make_stack([1, 1], keep=1) as stack:
        assert stack.sim is not None
        bus = ["--nats", stack.nats_url, "--fleet", stack.fleet_name]
        for version in (1, 2, 3):
            done = await run_lorabus(
                "update", *bus, "--adapter", "policy", "--path", make_adapter(version),
                "--version", str(version), "--keep", "2", "--json",
            )  # fmt: skip
            assert done.returncode == 0, done
            assert json.loads(done.stdout)["adapter"] == f"policy-v{version}"
        async with asyncio.timeout(DEADLINE_S):
            for worker in stack.sim.workers.values():
                await worker.wait_until(
                    lambda w=worker: set(w.adapters) == {"policy-v2", "policy-v3"}
                )


@pytest.mark.parametrize("keep", ["0", "65", "two"])
async def test_a_keep_outside_1_to_64_is_a_usage_error(
    keep: str, nats_url: str, fleet_name: str
) -> None:
    done = await run_lorabus(
        "update", "--nats", nats_url, "--fleet", fleet_name, "--adapter", "policy",
        "--path", "/ckpt/step_1", "--keep", keep,
    )  # fmt: skip

    assert done.returncode == 2, done
    assert "--keep" in done.stderr
