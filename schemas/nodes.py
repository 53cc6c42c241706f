"""Which workers each node agent speaks for: the file ``lorabus auth init --node`` writes.

A node agent acks and beats for several workers in one message on its
node's subject (``NodeAcks``, ``NodeBeats``). Server permissions prove which
node sent it; this file, written beside those permissions into the
coordinator's identity, says which workers that node may speak for, so a
node cannot ack or beat in another node's (or a lone agent's) name.
"""

from __future__ import annotations

import msgspec

from lorabus.schemas.reports import MAX_NODE_WORKERS
from lorabus.schemas.subjects import check_token

NODES_ENV = "LORABUS_NODES_FILE"
"""Names the nodes file (an identity's ``lorabus.env`` sets it)."""


def check_nodes(nodes: dict[str, list[str]]) -> dict[str, list[str]]:
    """``nodes`` if each names 1-``MAX_NODE_WORKERS`` workers, no worker is
    on two nodes and no node has a worker's name; else ValueError."""
    seen: dict[str, str] = {}
    for node, workers in nodes.items():
        check_token("node name", node)
        if not 1 <= len(workers) <= MAX_NODE_WORKERS:
            raise ValueError(
                f"node {node!r} must name 1-{MAX_NODE_WORKERS} workers, got {len(workers)}"
            )
        for worker in workers:
            check_token("worker id", worker)
            if worker in seen:
                raise ValueError(f"worker {worker!r} is on nodes {seen[worker]!r} and {node!r}")
            seen[worker] = node
    clash = sorted(set(nodes) & set(seen))
    if clash:
        raise ValueError(f"node {clash[0]!r} has the name of a worker: its subjects would be one")
    return nodes


def encode_nodes(nodes: dict[str, list[str]]) -> bytes:
    return msgspec.json.format(msgspec.json.encode(check_nodes(nodes)), indent=2) + b"\n"


def decode_nodes(data: bytes) -> dict[str, list[str]]:
    """ValueError (or msgspec.DecodeError) for anything but a valid nodes file."""
    return check_nodes(msgspec.json.decode(data, type=dict[str, list[str]]))
