"""Deterministic identifiers of the simulated fleet.

Real Dynamo derives an adapter's ``lora_id`` from its name (so every replica
agrees) and gives each worker an unsigned 64-bit discovery ``instance_id``. Tests and the
demo compare these numbers across workers and runs, so they are pure functions
of names here, never random.
"""

from __future__ import annotations

import hashlib

__all__ = ["instance_id_for", "lora_id_for", "numbered_worker_ids"]

_LORA_ID_MODULUS = 2**31 - 1


def _digest64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def lora_id_for(lora_name: str) -> int:
    """The adapter id every worker reports for ``lora_name``: in ``[1, 2**31)``."""
    return _digest64(lora_name) % _LORA_ID_MODULUS + 1


def instance_id_for(worker_id: str) -> int:
    """A worker's discovery instance id: an unsigned 64-bit integer.

    Real ids use all 64 bits (e.g. 11607668055850419719, above 2**63), so a
    client that reads them as signed 64-bit integers breaks; so do these.
    """
    return _digest64(worker_id)


def numbered_worker_ids(n: int) -> list[str]:
    """``w000`` .. ``w{n-1}``, zero-padded to at least three digits.

    The padding grows with ``n`` so that string order equals numeric order.
    """
    if n < 0:
        raise ValueError(f"fleet size must be >= 0, got {n}")
    width = max(3, len(str(n - 1)) if n else 3)
    return [f"w{i:0{width}d}" for i in range(n)]
