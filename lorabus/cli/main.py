"""The ``lorabus`` command group.

Exit codes: 0 success (an update committed), 1 failure (an update failed, a
service died, a lorabus error), 2 bad usage (click's convention).
"""

from __future__ import annotations

import logging
import sys

import click

from lorabus._version import __version__
from lorabus.cli import audit, demo, measure, orchestrate, serve


@click.group()
@click.version_option(__version__, prog_name="lorabus")
@click.option(
    "--log-level",
    default="WARNING",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
def main(log_level: str) -> None:
    """lorabus: roll LoRA adapters out across inference workers over NATS."""
    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


for command in (
    serve.agent,
    serve.coordinator,
    orchestrate.update,
    orchestrate.status,
    orchestrate.schema,
    audit.tap,
    audit.audit,
    demo.up,
    demo.sim,
    measure.bench,
    measure.chaos,
):
    main.add_command(command)
