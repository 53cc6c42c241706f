"""What every group of commands shares: bus options, auth headers, integer
lists, and running a command's coroutine until it ends or a signal stops it."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from lorabus.errors import LorabusError
from lorabus.options import auth_headers
from lorabus.schemas.subjects import DEFAULT_FLEET, Subjects

log = logging.getLogger("lorabus")

_F = TypeVar("_F", bound=Callable[..., Any])

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130

nats_option = click.option(
    "--nats",
    "nats_url",
    envvar="LORABUS_NATS_URL",
    required=True,
    show_envvar=True,
    help="NATS server URL (a comma-separated list for the nodes of a cluster).",
)
fleet_option = click.option(
    "--fleet",
    envvar="LORABUS_FLEET",
    default=DEFAULT_FLEET,
    show_default=True,
    show_envvar=True,
    help="Fleet name; many fleets can share one NATS.",
)


def auth_options(command: _F) -> _F:
    """``--api-key-env`` and ``--header``, turned into headers by :func:`headers_from`."""
    command = click.option(
        "--header",
        "headers",
        multiple=True,
        metavar="NAME=VALUE",
        help="Extra HTTP header on every call (repeatable).",
    )(command)
    return click.option(
        "--api-key-env",
        metavar="VAR",
        help="Send 'Authorization: Bearer $VAR' (unless unset or EMPTY).",
    )(command)


def headers_from(api_key_env: str | None, headers: tuple[str, ...]) -> dict[str, str]:
    try:
        return auth_headers(api_key_env, headers)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--header") from exc


def subjects_of(fleet: str) -> Subjects:
    """The fleet's subjects; a fleet name that cannot be a subject token is a usage error."""
    try:
        return Subjects(fleet=fleet)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


class IntList(click.ParamType):
    """Positive integers separated by commas, e.g. ``2,4,1``."""

    name = "N,N,..."

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> list[int]:
        if isinstance(value, list):
            return value
        try:
            numbers = [int(part) for part in str(value).split(",") if part.strip()]
        except ValueError:
            numbers = []
        if not numbers or min(numbers) < 1:
            self.fail(f"give positive integers separated by commas, e.g. 2,4,1 (got {value!r})")
        return numbers


INT_LIST = IntList()


def run(main: Callable[[], Awaitable[int]]) -> int:
    """Run ``main`` to its exit code; SIGTERM or SIGINT cancels it cleanly (130),
    and a lorabus error is printed as one line (1), not as a traceback."""

    async def guarded() -> int:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await main()
        except asyncio.CancelledError:
            log.info("stopped by signal")
            return EXIT_INTERRUPTED
        except LorabusError as exc:
            click.echo(f"error: {exc}", err=True)
            return EXIT_FAILED

    return asyncio.run(guarded())
