"""What a command may make this agent's engine read, and under what name.

The coordinator checks a request's path before it plans an update, but the
engine reads the path on the agent's host, where the coordinator may not see
it at all, and where a symlink inside an adapter root can lead anywhere. So
each agent checks the path again, on its own host, against its own
``--adapter-root`` directories, and hands the engine the path it checked:
the resolved one, so a symlink swapped after the check cannot send the
engine elsewhere (whoever can rename directories inside a root can still
change what it holds).

Without adapter roots the agent sets no boundary and does not look at the
filesystem: the path goes to the engine as the coordinator sent it, and the
engine's own checks (and messages) apply. An agent may run where the engine's
files are not mounted; roots are the operator saying they are.

Served names end up in engine URLs (``DELETE /v1/loras/<name>``), so a name
is checked against the coordinator's rule before any engine call, and drivers
put it in a URL as one percent-encoded segment.

Both checks raise :class:`ValueError` with the reason; the executor turns it
into the ack's error. They are plain functions, so they are tested without a
bus or an engine.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

__all__ = [
    "ADAPTER_CONFIG",
    "MAX_SERVED_NAME",
    "check_served_name",
    "is_within",
    "resolve_adapter_dir",
]

ADAPTER_CONFIG = "adapter_config.json"
"""The file that makes a directory a PEFT adapter (written first, read first)."""

MAX_SERVED_NAME = 150
"""An adapter name (at most 128 characters), ``-v`` and a version (at most 20 digits)."""

# The coordinator's rule for adapter names (coordinator/plan.py), with room for
# the ``-v<version>`` a versioned served name adds.
_SERVED_NAME = re.compile(
    rf"^[A-Za-z0-9](?:[A-Za-z0-9._/-]{{0,{MAX_SERVED_NAME - 2}}}[A-Za-z0-9])?$"
)


def check_served_name(name: str) -> str:
    """Return ``name`` if it is a served name the coordinator could have made, else
    raise ValueError: letters, digits and ``. _ / -``, a letter or digit at each end,
    no ``..`` and no ``//``, at most :data:`MAX_SERVED_NAME` characters."""
    if not _SERVED_NAME.match(name) or ".." in name or "//" in name:
        raise ValueError(
            f"served name {name!r} is not valid: use letters, digits and '.', '_', '-', '/' "
            f"(not at either end, no '..' or '//'), at most {MAX_SERVED_NAME} characters"
        )
    return name


def is_within(path: str, root: str) -> bool:
    """True if ``path`` is ``root`` or below it (both absolute and normalized)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def resolve_adapter_dir(path: str, roots: Sequence[str]) -> str:
    """The path to hand the engine for adapter directory ``path``, or ValueError.

    Without ``roots``: ``path`` itself, once it is absolute (nothing is read
    from disk). With ``roots``: the path with every symlink and ``..``
    resolved, which must exist, lie under one of the roots (each resolved
    too, so a root may itself be a symlink) and be a directory holding
    ``adapter_config.json``. A few ``stat`` calls; on a network filesystem
    they can block, so async callers run this in a thread.
    """
    if "\0" in path or not os.path.isabs(path):
        raise ValueError(f"adapter path {path!r} is not an absolute path")
    if not roots:
        return path
    try:
        real = os.path.realpath(path, strict=True)
    except OSError as exc:
        raise ValueError(
            f"adapter path {path!r} cannot be resolved on this host: {exc.strerror or exc}"
        ) from exc
    real_roots = [os.path.realpath(root) for root in roots]
    if not any(is_within(real, root) for root in real_roots):
        shown = f"{path!r}" if real == path else f"{path!r} (resolved: {real!r})"
        raise ValueError(f"adapter path {shown} is outside the adapter roots {list(roots)}")
    if not os.path.isdir(real):
        raise ValueError(f"adapter path {path!r} is not a directory")
    if not os.path.isfile(os.path.join(real, ADAPTER_CONFIG)):
        raise ValueError(f"adapter path {path!r} holds no {ADAPTER_CONFIG}")
    return real
