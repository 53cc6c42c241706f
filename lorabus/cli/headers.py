"""Turning command-line auth options into HTTP headers, in one place.

Control clients that set the API key per call forget it on some calls; here the agent
(engine calls) and the coordinator (frontend calls) build their headers from
the same two options, and every request of theirs carries them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

log = logging.getLogger(__name__)

NO_KEY = "EMPTY"


def parse_header(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` -> (NAME, VALUE); raises ValueError for anything else."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name or any(c.isspace() or c == ":" for c in name):
        raise ValueError(f"header {text!r} is not NAME=VALUE")
    return name, value


def auth_headers(
    api_key_env: str | None,
    headers: Iterable[str] = (),
    environ: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """Headers for every engine or frontend call.

    ``Authorization: Bearer <key>`` when ``api_key_env`` names a set variable
    whose value is not ``EMPTY`` (vLLM's convention for "no key"), plus each
    ``NAME=VALUE`` of ``headers``.
    """
    result: dict[str, str] = {}
    if api_key_env:
        key = environ.get(api_key_env)
        if key is None:
            log.warning("$%s is not set: calls go out without an Authorization header", api_key_env)
        elif key != NO_KEY:
            result["Authorization"] = f"Bearer {key}"
    for text in headers:
        name, value = parse_header(text)
        result[name] = value
    return result
