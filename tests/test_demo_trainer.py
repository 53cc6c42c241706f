"""The demo trainer's adapter is the same PEFT adapter whether torch writes it or numpy does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from lorabus.testbed.trainer import write_adapter


def test_without_torch_the_adapter_holds_lora_a_and_b_per_targeted_module(tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path, 2, rank=4, hidden=16, layers=1, with_torch=False)
    tensors = load_file(adapter / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.self_attn"
    assert {name: (a.shape, str(a.dtype)) for name, a in tensors.items()} == {
        f"{prefix}.{module}.lora_{kind}.weight": (shape, "float32")
        for module in ("q_proj", "v_proj")
        for kind, shape in (("A", (4, 16)), ("B", (16, 4)))
    }
    assert sorted(p.name for p in adapter.iterdir()) == [
        "STABLE",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


def test_with_torch_the_adapter_is_saved_by_torch_and_has_the_same_bytes(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="the torch writer needs lorabus[torch]")
    import safetensors.torch

    by_torch = write_adapter(tmp_path / "torch", 3, with_torch=True)
    by_numpy = write_adapter(tmp_path / "numpy", 3, with_torch=False)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (by_torch / name).read_bytes() == (by_numpy / name).read_bytes(), name
    loaded = safetensors.torch.load_file(by_torch / "adapter_model.safetensors")
    assert len(loaded) == 8
    assert {t.dtype for t in loaded.values()} == {torch.float32}


def test_torch_writes_it_by_default_when_installed(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the torch writer needs lorabus[torch]")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from lorabus.testbed.trainer import write_adapter; "
            f"write_adapter(pathlib.Path({str(tmp_path)!r}), 1); "
            "print('safetensors.torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
