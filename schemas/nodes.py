"""Which workers each node agent speaks for: the file ``lorabus auth init --node`` writes.

A node agent acks and beats for several workers in one message on its
node's subject (``NodeAcks``, ``NodeBeats``). Server permissions prove which
node sent it; this file, written beside those permissions into the
identities that read acks and beats (the coordinator's, and the
orchestrator's, auditor's and operator's for ``status`` and ``audit
verify``), says which workers that node may speak for, so a node cannot
ack or beat in another node's (or a lone agent's) name.

With the file, a reader takes a node's entries only for the node's own
workers, and nothing from a node the file does not list. Without one, a
coordinator that signs its commands (a fleet with identities, where each
lone agent may publish on the ack subject of its own id) takes no node's
message at all; any other reader, and a coordinator that signs nothing (a
bus without permissions, where anyone may publish anything anyway), takes
a node's messages for the workers they name.
"""

from __future__ import annotations

import os

import msgspec

from lorabus.schemas.reports import MAX_NODE_WORKERS
from lorabus.schemas.subjects import check_token

NODES_ENV = "LORABUS_NODES_FILE"
"""Names the nodes file (an identity's ``lorabus.env`` sets it)."""
NODE_ENV = "LORABUS_NODE"
"""A node agent's identity names its node (its ``lorabus.env`` sets it):
the only node whose subjects it may publish on."""


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


class NodeRoster:
    def __init__(self, nodes: dict[str, list[str]] | None = None) -> None:
        self._nodes = None if nodes is None else {n: frozenset(w) for n, w in nodes.items()}

    @classmethod
    def from_env(cls) -> NodeRoster:
        """The roster of ``$LORABUS_NODES_FILE`` (an identity's ``lorabus.env``
        names it for the coordinator, the orchestrator, the auditor and the
        operator), else open."""
        return cls.load(os.environ.get(NODES_ENV, ""))

    @classmethod
    def load(cls, path: str, *, secured: bool = False) -> NodeRoster:
        """The roster of the nodes file at ``path`` ("": none, so open, or
        closed to every node when ``secured``). ValueError, saying what is
        wrong, for a file that cannot be read."""
        if not path:
            return cls({}) if secured else cls()
        try:
            with open(path, "rb") as file:
                return cls(decode_nodes(file.read()))
        except (OSError, msgspec.DecodeError, ValueError) as exc:
            raise ValueError(f"nodes file {path}: {exc}") from None

    def refusal(self, node: str, worker_id: str) -> str | None:
        """Why node ``node`` may not speak for ``worker_id`` (None: it may)."""
        if self._nodes is None:
            return None
        workers = self._nodes.get(node)
        if workers is None:
            return f"node {node!r} is not in the nodes file"
        if worker_id not in workers:
            return f"node {node!r} speaks for {worker_id!r}, which is not one of its workers"
        return None

    def is_node(self, name: str) -> bool:
        """Whether ``name`` is a listed node's: no lone worker acks or beats there."""
        return self._nodes is not None and name in self._nodes
