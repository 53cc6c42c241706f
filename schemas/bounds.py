"""Bounded field types: what any receiver accepts, whoever sent it.

Every message is untrusted input, so every field a peer fills in has a bound
here, checked by the decoder itself (msgspec ``Meta`` constraints).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated

import msgspec

INT64_MAX = 2**63 - 1
MAX_WORLD_SIZE = 4096
"""The most GPUs one engine may span (tensor x pipeline parallel)."""
MAX_NAMES = 65536
"""The most entries of any list on the wire (adapters, targets, members)."""
MAX_SECONDS = 86400.0
"""The longest duration any message may carry (budgets, leases, intervals)."""

WORKER_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}\Z"
UPDATE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}\Z"
DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}\Z"

WorkerId = Annotated[str, msgspec.Meta(pattern=WORKER_ID_PATTERN)]
"""A subject token: 1-64 letters, digits, '_' or '-'."""
UpdateId = Annotated[str, msgspec.Meta(pattern=UPDATE_ID_PATTERN)]
"""1-128 letters, digits, '_', '.', ':' or '-', starting with a letter or digit."""
Digest = Annotated[str, msgspec.Meta(pattern=DIGEST_PATTERN)]
"""An adapter directory's content digest: ``sha256:`` and 64 lowercase hex
digits (docs/protocol.md defines what is hashed)."""
SeenDigest = Annotated[str, msgspec.Meta(pattern=r"^(sha256:[0-9a-f]{64})?\Z")]
"""A digest as an agent saw it, or "" when it could not read the directory."""
Name = Annotated[str, msgspec.Meta(max_length=256)]
"""An adapter or served name as an engine reports it."""
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Path = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
Version = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Epoch = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
WorldSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD_SIZE)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
Interval = Annotated[float, msgspec.Meta(gt=0, le=MAX_SECONDS)]
WorkerIds = Annotated[list[WorkerId], msgspec.Meta(max_length=MAX_NAMES)]
Names = Annotated[list[Name], msgspec.Meta(max_length=MAX_NAMES)]
MAX_SHARED_PAUSE = 1024
"""Updates one pause may be shared with (a round of pause-mode updates)."""
UpdateIds = Annotated[list[UpdateId], msgspec.Meta(max_length=MAX_SHARED_PAUSE)]
Capacity = Annotated[int, msgspec.Meta(ge=1, le=MAX_NAMES)]
"""The most adapters one engine holds at once."""
MAX_KEEP = 64
"""The most versions of one adapter a request may ask engines to keep."""
Keep = Annotated[int, msgspec.Meta(ge=1, le=MAX_KEEP)]
LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z"
LabelText = Annotated[str, msgspec.Meta(pattern=LABEL_PATTERN)]
"""A worker label's key or value (``zone``, ``us-east-1a``): 1-63 letters,
digits, '_', '.' or '-', starting with a letter or digit."""
MAX_LABELS = 16
"""The most labels one worker announces, or one selector names."""
Labels = Annotated[dict[LabelText, LabelText], msgspec.Meta(max_length=MAX_LABELS)]
Replicas = Annotated[int, msgspec.Meta(ge=1, le=MAX_NAMES)]
"""How many workers an update places its adapter on."""


def parse_labels(specs: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` specs as labels; ValueError, saying which, for a bad one."""
    labels: dict[str, str] = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep or not all(re.fullmatch(LABEL_PATTERN, part) for part in (key, value)):
            raise ValueError(
                f"label {spec!r} is not KEY=VALUE of 1-63 letters, digits, '_', '.' or '-' each"
            )
        if key in labels:
            raise ValueError(f"label {key!r} is given twice")
        labels[key] = value
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels, got {len(labels)}")
    return labels
