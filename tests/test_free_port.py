"""The ports that tests and ``lorabus up`` pick for nats-server and the simulated fleet."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lorabus.testbed.natsserver import free_port

PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's port range")
def test_a_picked_port_is_never_one_the_kernel_may_hand_out_meanwhile() -> None:
    """A port picked now is bound later by another process; an ephemeral port
    could be taken in between by a proxy bound to port 0 or by any outgoing
    connection, and the nats-server would exit with "address already in use"."""
    low, high = (int(port) for port in PORT_RANGE.read_text().split())
    if low < 21000:
        pytest.skip(f"this kernel hands out ports from {low} on: no port is safe from it")
    picked = [free_port() for _ in range(50)]
    assert not set(picked) & set(range(low, high + 1))


def test_one_process_is_never_handed_the_same_port_twice() -> None:
    """The ports of one fleet are picked together and bound later: a repeat
    would be two servers on one port."""
    picked = [free_port() for _ in range(500)]
    assert len(set(picked)) == len(picked)
