"""Where a LoRA load request points, checked the way a Dynamo worker does.

A load names its adapter by URI. The simulator accepts only ``file://`` URIs
(like a worker without S3 or Hugging Face credentials) and checks that the
directory holds a PEFT adapter; it never reads the weights. The messages copy
the real runtime's, because agents and operators match on them.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

__all__ = ["ADAPTER_FILES", "LoraSourceError", "check_adapter_dir", "local_path_of"]

#: Files a PEFT LoRA adapter directory must contain, checked in this order.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class LoraSourceError(Exception):
    """Raised when a load's source cannot be used; ``str()`` is the message."""


def local_path_of(uri: str) -> str:
    """The percent-decoded local path of a ``file://`` URI.

    Raises LoraSourceError for other schemes and for ``file://`` URIs naming
    another host, which a worker cannot read either.
    """
    parts = urlsplit(uri)
    if parts.scheme != "file":
        raise LoraSourceError(f"unsupported LoRA source scheme: {parts.scheme or '(none)'}")
    path = unquote(parts.path)
    if parts.netloc not in ("", "localhost"):
        raise LoraSourceError(f"failed to resolve LoRA source: Local LoRA not found: {uri}")
    return path


def check_adapter_dir(path: str) -> None:
    """Raise LoraSourceError unless ``path`` is a directory with the adapter files.

    These are a handful of stat calls on local paths, cheap enough to run on the
    event loop even when a thousand workers load at once.
    """
    directory = Path(path)
    if not directory.is_absolute() or not directory.is_dir():
        raise LoraSourceError(f"failed to resolve LoRA source: Local LoRA not found: {path}")
    for name in ADAPTER_FILES:
        if not (directory / name).is_file():
            raise LoraSourceError(f"not a LoRA adapter: {path} has no {name}")
