"""A tiny stand-in for an RL trainer: writes one PEFT LoRA adapter per step.

The layout is what real trainers write and engines load: ``adapter_config.json``,
``adapter_model.safetensors`` with ``lora_A`` ([r, in]) and ``lora_B``
([out, r]) tensors per targeted module, then an empty ``STABLE`` marker once
everything else is on disk, so a reader never sees a half-written adapter.

With torch installed (the ``torch`` extra) the tensors are saved as torch
tensors with ``safetensors.torch``, as a torch trainer saves them; without
it, with numpy. The values come from the same seeded numpy generator either
way, so an adapter's bytes do not depend on which extras a host has.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import safetensors.numpy

TARGET_MODULES = ("q_proj", "v_proj")


def write_adapter(
    root: Path,
    step: int,
    *,
    rank: int = 8,
    hidden: int = 64,
    layers: int = 2,
    base_model: str = "sim-base",
    seed: int = 0,
    with_torch: bool | None = None,
) -> Path:
    """Write step ``step``'s adapter under ``root/step_<step>`` and return its path.

    ``with_torch``: save through torch (None: when torch is installed)."""
    directory = root / f"step_{step}"
    directory.mkdir(parents=True, exist_ok=False)
    rng = np.random.default_rng(seed + step)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(layers):
        for module in TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                rng.standard_normal((rank, hidden), dtype=np.float32) * 0.01
            )
            # PEFT initialises B to zero; a trained step has moved it off zero.
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal(
                (hidden, rank), dtype=np.float32
            ) * (0.001 * step)
    if with_torch is None:
        with_torch = importlib.util.find_spec("torch") is not None
    weights = directory / "adapter_model.safetensors"
    if with_torch:
        _save_with_torch(tensors, weights)
    else:
        safetensors.numpy.save_file(tensors, str(weights))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "base_model_name_or_path": base_model,
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    (directory / "STABLE").touch()
    return directory


def _save_with_torch(tensors: dict[str, np.ndarray], path: Path) -> None:
    # Imported here: torch is an optional extra and takes seconds to import.
    import safetensors.torch
    import torch

    safetensors.torch.save_file({name: torch.from_numpy(a) for name, a in tensors.items()}, path)
