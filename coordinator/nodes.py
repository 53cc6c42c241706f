"""Which workers a node agent may ack and beat for (``lorabus.schemas.nodes``).

Without a nodes file the coordinator takes a node's messages for whatever
workers they name, as it takes any agent's on a bus without permissions;
with one (``lorabus auth init --node`` writes it), only for the node's own
workers, and nothing from a node the file does not list.
"""

from __future__ import annotations

import msgspec

from lorabus.schemas.nodes import decode_nodes


class NodeRoster:
    def __init__(self, nodes: dict[str, list[str]] | None = None) -> None:
        self._nodes = None if nodes is None else {n: frozenset(w) for n, w in nodes.items()}

    @classmethod
    def load(cls, path: str) -> NodeRoster:
        """The roster of the nodes file at ``path`` ("": none, so open).
        ValueError, saying what is wrong, for a file that cannot be read."""
        if not path:
            return cls()
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
