"""A small PEFT-shaped adapter directory, for the tests of the object store
and the caches: a config, weights, and a file one level down (what the
archive must carry with its path)."""

from __future__ import annotations

from pathlib import Path


def write_adapter(root: Path, weights: bytes = b"weights") -> Path:
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text('{"r": 8}')
    (root / "adapter_model.safetensors").write_bytes(weights)
    (root / "sub").mkdir()
    (root / "sub" / "notes.txt").write_text("step")
    return root
