"""Where a LoRA load request points, checked the way a Dynamo worker does.

A load names its adapter by URI. A real Dynamo 1.6.1 worker resolves it in two
steps, and so does the simulator: the runtime's downloader turns the URI into
a local directory (:func:`resolve_local`, failing with
:class:`SourceNotFound`), then the engine reads the adapter from it
(:func:`check_adapter_dir`, failing with :class:`NotAnAdapter`). The simulator
accepts only ``file://`` URIs (like a worker without S3 or Hugging Face
credentials) and never reads the weights. The downloader's messages copy the
real runtime's (observed in the ``real_dynamo`` tier), because agents and
operators match on them. The engine's message depends on the engine behind
Dynamo: the simulator answers with vLLM's words (``LoRAAdapterNotFoundError``:
"No adapter found for <path>"), which agents take as final, and adds the file
it found missing.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

__all__ = [
    "ADAPTER_FILES",
    "LoraSourceError",
    "NotAnAdapter",
    "SourceNotFound",
    "check_adapter_dir",
    "check_local_adapter",
    "resolve_local",
]

#: Files a PEFT LoRA adapter directory must contain, checked in this order.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class LoraSourceError(Exception):
    """Raised when a load's source cannot be used; ``str()`` is the message."""


class SourceNotFound(LoraSourceError):
    """Raised when the downloader cannot resolve the URI to a local directory."""


class NotAnAdapter(LoraSourceError):
    """Raised when the directory exists but holds no PEFT adapter; ``str()`` is
    vLLM's words plus what is missing, ``No adapter found for <path> (<missing>)``."""

    def __init__(self, path: str, missing: str):
        super().__init__(f"No adapter found for {path} ({missing})")
        self.path = path
        self.missing = missing


def resolve_local(uri: str) -> str:
    """The percent-decoded local path of a ``file://`` URI naming something that exists.

    Like the runtime's downloader it names the URI, not the path, when it
    fails: other schemes are "not found in any source", a ``file://`` URI with
    a host or a path that does not exist is "Local LoRA not found". These are a
    handful of stat calls, cheap enough for the event loop even when a thousand
    workers load at once.
    """
    parts = urlsplit(uri)
    if parts.scheme != "file":
        raise SourceNotFound(f"LoRA {uri} not found in any source")
    path = unquote(parts.path)
    if parts.netloc not in ("", "localhost") or not Path(path).is_absolute():
        raise SourceNotFound(f"Local LoRA not found: {uri}")
    if not Path(path).exists():
        raise SourceNotFound(f"Local LoRA not found: {uri}")
    return path


def check_adapter_dir(path: str) -> None:
    """Raise NotAnAdapter unless ``path`` is a directory with the adapter files."""
    directory = Path(path)
    if not directory.is_dir():
        raise NotAnAdapter(path, "not a directory")
    for name in ADAPTER_FILES:
        if not (directory / name).is_file():
            raise NotAnAdapter(path, f"no {name}")


def check_local_adapter(path: str) -> None:
    """Raise NotAnAdapter unless ``path`` is an absolute path to an adapter
    directory: how vLLM and SGLang take a load's ``lora_path``, with no
    downloader in front (a path that is not a local directory would be looked
    up on a model hub, which the simulator has no access to)."""
    if not Path(path).is_absolute():
        raise NotAnAdapter(path, "not an absolute path")
    check_adapter_dir(path)
