"""Which workers a node agent may ack and beat for (``lorabus.schemas.nodes``).

With a nodes file (``lorabus auth init --node`` writes it) the coordinator
takes a node's acks and beats only for the node's own workers, and nothing
from a node the file does not list. Without one, a coordinator that signs
its commands (a fleet with identities, where each lone agent may publish on
the ack subject of its own id) takes no node's message at all: anyone
could otherwise speak for every worker from their own subject. Only a
coordinator that signs nothing (a bus without permissions, where anyone
may publish anything anyway) takes a node's messages for the workers they
name.
"""

from __future__ import annotations

import msgspec

from lorabus.schemas.nodes import decode_nodes


class NodeRoster:
    def __init__(self, nodes: dict[str, list[str]] | None = None) -> None:
        self._nodes = None if nodes is None else {n: frozenset(w) for n, w in nodes.items()}

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
            return f"node {node!r} is not in the coordinator's nodes file"
        if worker_id not in workers:
            return f"node {node!r} speaks for {worker_id!r}, which is not one of its workers"
        return None

    def is_node(self, name: str) -> bool:
        """Whether ``name`` is a listed node's: no lone worker acks or beats there."""
        return self._nodes is not None and name in self._nodes
