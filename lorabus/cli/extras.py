"""Optional dependencies: which of an extra's distributions are missing, said clearly.

The development tools run :mod:`lorabus.testbed`, which needs the ``sim``
extra (a private nats-server, aiohttp for the simulated fleet, numpy and
safetensors for the demo trainer's adapters). Without it each of those
commands says which extra to install, instead of failing on an import.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterable

import click

SIM_EXTRA = "sim"


def require_sim_extra() -> None:
    """Raise a clear error naming the extra when a distribution of it is missing."""
    missing = missing_from_extra(SIM_EXTRA)
    if missing:
        command = click.get_current_context().info_name
        raise click.ClickException(
            f"'lorabus {command}' needs the {SIM_EXTRA} extra, which is not installed "
            f"(missing: {', '.join(missing)}): pip install 'lorabus[{SIM_EXTRA}]'"
        )


def missing_from_extra(extra: str) -> list[str]:
    """The distributions of lorabus's ``extra`` that are not installed, read from
    the package's own metadata (so the list lives in pyproject.toml only)."""
    try:
        requirements = importlib.metadata.requires("lorabus") or []
    except importlib.metadata.PackageNotFoundError:
        return []  # not installed at all: imports will tell
    return missing_distributions(requirements, extra)


def missing_distributions(requirements: Iterable[str], extra: str) -> list[str]:
    """The distributions that ``requirements`` (``Requires-Dist`` lines) name for
    ``extra`` and that are not installed; lorabus itself (an extra of an extra) is skipped."""
    missing = []
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        if f'extra == "{extra}"' not in marker.replace("'", '"'):
            continue
        name = re.match(r"[A-Za-z0-9._-]+", spec.strip())
        if name is None or name.group(0) == "lorabus":
            continue
        try:
            importlib.metadata.distribution(name.group(0))
        except importlib.metadata.PackageNotFoundError:
            missing.append(name.group(0))
    return missing
