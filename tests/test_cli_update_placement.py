"""``lorabus update --replicas K --selector KEY=VALUE``: the adapter goes to
the workers whose agents announce the label (``lorabus agent --label``), K
of them; ``lorabus status`` names them. A bad selector is a usage error.

A whole fleet (simulated workers, agents with labels, a coordinator in live
mode) runs in this process; the CLI runs as a real process against it.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from processes import run_lorabus

from lorabus.schemas import UpdateMode
from lorabus.testbed.stack import EmbeddedStack


async def test_update_places_the_adapter_by_replicas_and_labels(
    make_stack: Callable[..., EmbeddedStack], make_adapter: Callable[[int], str]
) -> None:
    zones = [["zone=a"], ["zone=b"], ["zone=b"]]
    async with make_stack([1, 2, 1], labels=zones, mode=UpdateMode.LIVE) as stack:
        assert stack.sim is not None
        bus = ["--nats", stack.nats_url, "--fleet", stack.fleet_name]
        done = await run_lorabus(
            "update", *bus, "--adapter", "policy", "--path", make_adapter(1), "--version", "1",
            "--replicas", "1", "--selector", "zone=b", "--json",
        )  # fmt: skip
        assert done.returncode == 0, done
        result = json.loads(done.stdout)
        (placed,) = [entry["worker_id"] for entry in result["rank_map"]["entries"]]
        assert placed in ("w001", "w002"), result
        holding = [w for w, sim in stack.sim.workers.items() if "policy-v1" in sim.adapters]
        assert holding == [placed]

        shown = await run_lorabus("status", *bus)
        assert shown.returncode == 0, shown
        assert f"placed on 1: {placed}" in shown.stdout, shown.stdout
        assert "[zone=b]" in shown.stdout


@pytest.mark.parametrize("selector", ["zone", "=b", "zone=b c"])
async def test_a_bad_selector_is_a_usage_error(
    selector: str, nats_url: str, fleet_name: str
) -> None:
    done = await run_lorabus(
        "update", "--nats", nats_url, "--fleet", fleet_name, "--adapter", "policy",
        "--path", "/ckpt/step_1", "--selector", selector,
    )  # fmt: skip
    assert done.returncode == 2, done
    assert "--selector" in done.stderr and "KEY=VALUE" in done.stderr, done.stderr
