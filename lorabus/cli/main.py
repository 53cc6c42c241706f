"""The ``lorabus`` command group.

Exit codes: 0 success (an update committed), 1 failure (an update failed, a
service died, a lorabus error), 2 bad usage (click's convention), 130
stopped by SIGTERM or SIGINT.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

from lorabus._version import __version__
from lorabus.bus.options import identity_env
from lorabus.cli import adapters, admin, audit, demo, measure, orchestrate, serve


@click.group()
@click.version_option(__version__, prog_name="lorabus")
@click.option(
    "--log-level",
    default="WARNING",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.option(
    "--identity",
    type=click.Path(exists=True, file_okay=False),
    envvar="LORABUS_IDENTITY",
    show_envvar=True,
    help="An identity folder of lorabus auth init: connect as it (its lorabus.env).",
)
def main(log_level: str, identity: str | None) -> None:
    """lorabus: roll LoRA adapters out across inference workers over NATS."""
    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if log_level.upper() != "DEBUG":
        # One line per HTTP request would be most of an agent's log at INFO.
        for chatty in ("httpx", "httpcore"):
            logging.getLogger(chatty).setLevel(logging.WARNING)
    context = click.get_current_context()
    context.obj = {
        "log_level_given": context.get_parameter_source("log_level")
        is not click.core.ParameterSource.DEFAULT
    }
    if identity is not None:
        # The command's options read these variables when it is parsed, after this.
        os.environ.update(identity_env(Path(identity)))


for command in (
    serve.agent,
    serve.coordinator,
    orchestrate.update,
    adapters.adapter,
    orchestrate.status,
    orchestrate.result,
    orchestrate.schema,
    audit.tap,
    audit.audit,
    admin.auth,
    admin.provision,
    admin.reset,
    demo.up,
    demo.sim,
    measure.bench,
    measure.chaos,
):
    main.add_command(command)
