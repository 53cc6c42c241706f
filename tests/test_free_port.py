"""The ports that tests and ``lorabus up`` pick for nats-server and the simulated fleet."""

from __future__ import annotations

from pathlib import Path

from lorabus.testbed.natsserver import free_port


def _ephemeral_ports() -> range:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return range(int(low), int(high) + 1)


def test_a_picked_port_is_never_one_the_kernel_may_hand_out_meanwhile() -> None:
    """A port picked now is bound later by another process; an ephemeral port
    could be taken in between by a proxy bound to port 0 or by any outgoing
    connection, and the nats-server would exit with "address already in use"."""
    ephemeral = _ephemeral_ports()
    picked = {free_port() for _ in range(50)}
    assert not picked & set(ephemeral)
