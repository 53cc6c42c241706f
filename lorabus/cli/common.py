"""What every group of commands shares: bus options, the fleet option and its
subjects, auth headers, integer lists, and running a command's coroutine
until it ends or a signal stops it."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import threading
import time
import typing
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

import click

from lorabus.bus.options import ENV, PASSWORD_ENV, BusOptions
from lorabus.cli.headers import auth_headers
from lorabus.errors import LorabusError
from lorabus.schemas.subjects import DEFAULT_FLEET, Subjects
from lorabus.schemas.tenants import TENANT_ENV

log = logging.getLogger("lorabus")

_F = TypeVar("_F", bound=Callable[..., Any])

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
EXIT_GRACE_S = 2.0
"""How long a stopped command may take, once its own clean-up is done, to
leave: asyncio's closing of the loop and the interpreter's shutdown wait on
tasks and threads without a bound."""


def bus_options(*, required: bool = True) -> Callable[[_F], _F]:
    """``--nats`` and how to connect as this process's identity (``--creds``,
    ``--nkey``, ``--nats-user``, TLS, ``--inbox-prefix``, ``--js-api-prefix``,
    ``--insecure``), each
    with its ``LORABUS_*`` variable; the command gets ``nats_url`` and
    ``bus: BusOptions``. Passwords and tokens come from the environment only."""

    def decorate(command: _F) -> _F:
        @functools.wraps(command)
        def with_bus(*args: Any, **kwargs: Any) -> Any:
            given = {name: kwargs.pop(name) for name in _BUS_FIELDS}
            try:
                kwargs["bus"] = BusOptions(**given)
            except ValueError as exc:
                raise click.UsageError(str(exc)) from exc
            return command(*args, **kwargs)

        decorated: Any = with_bus
        for option in reversed(_bus_option_list(required)):
            decorated = option(decorated)
        return typing.cast(_F, decorated)

    return decorate


_NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def _checked_nats_urls(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refuse a malformed ``--nats`` here, with the part at fault named, rather
    than as the NATS client's error from deep inside a connect."""
    if value is None:
        return None
    for part in (p.strip() for p in value.split(",")):
        url = part if "://" in part else f"nats://{part}"
        try:
            parsed = urllib.parse.urlsplit(url)
            parsed.port  # noqa: B018 (parsing the port is the check)
        except ValueError as exc:
            raise click.BadParameter(f"{part!r}: {exc}") from None
        if parsed.scheme not in _NATS_SCHEMES or not parsed.hostname:
            raise click.BadParameter(
                f"{part!r}: give nats://HOST:PORT (or tls://, ws://, wss://), "
                "several separated by commas"
            )
    return value


class _BusFlag(NamedTuple):
    """An option of how to connect: its name, the ``BusOptions`` field it
    sets (read from that field's ``LORABUS_*`` variable too), and its help."""

    name: str
    field: str
    help: str
    file: bool = False
    """Names a file, which must exist."""


_BUS_FLAGS = (
    _BusFlag(
        "--creds",
        "creds_file",
        "A .creds file (user JWT and nkey seed) of an operator-managed account.",
        file=True,
    ),
    _BusFlag(
        "--nkey",
        "nkey_seed_file",
        "A file holding this identity's nkey seed (as lorabus auth init writes).",
        file=True,
    ),
    _BusFlag("--nats-user", "user", f"A NATS user; its password is read from ${PASSWORD_ENV}."),
    _BusFlag(
        "--tls-ca",
        "tls_ca_file",
        "The CA of the server's certificate (turns TLS on).",
        file=True,
    ),
    _BusFlag(
        "--tls-cert",
        "tls_cert_file",
        "A client certificate, for mutual TLS (with --tls-key).",
        file=True,
    ),
    _BusFlag("--tls-key", "tls_key_file", "The client certificate's key.", file=True),
    _BusFlag(
        "--inbox-prefix",
        "inbox_prefix",
        "Where this identity's replies arrive (default: from its nkey, else _INBOX).",
    ),
    _BusFlag(
        "--js-api-prefix",
        "js_api_prefix",
        "Where this identity's account has the fleet's JetStream API "
        "(lorabus auth init sets it; default $JS.API).",
    ),
    _BusFlag(
        "--insecure",
        "insecure",
        "Allow credentials over plain nats://, or none, to a host that is not loopback.",
    ),
)
_BUS_FIELDS = tuple(flag.field for flag in _BUS_FLAGS)


def _bus_option_list(required: bool) -> list[Callable[[Any], Any]]:
    """``--nats``, then an option per :data:`_BUS_FLAGS` (``--insecure`` a flag)."""
    nats = click.option(
        "--nats",
        "nats_url",
        envvar="LORABUS_NATS_URL",
        required=required,
        show_envvar=True,
        callback=_checked_nats_urls,
        help="NATS server URL (a comma-separated list for the nodes of a cluster).",
    )
    file = click.Path(exists=True, dir_okay=False)
    return [
        nats,
        *(
            click.option(
                flag.name,
                flag.field,
                type=file if flag.file else None,
                is_flag=flag.field == "insecure",
                envvar=ENV[flag.field],
                show_envvar=True,
                help=flag.help,
            )
            for flag in _BUS_FLAGS
        ),
    ]


tenant_option = click.option(
    "--tenant",
    envvar=TENANT_ENV,
    default=None,
    show_envvar=True,
    help="Ask as this tenant of the fleet, on its own subjects (lorabus auth init "
    "--tenant writes it into the tenant's lorabus.env); its update ids begin with "
    "'<tenant>:'.",
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


def run(
    main: Callable[[], Awaitable[int]],
    *,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> int:
    """Run ``main`` to its exit code; SIGTERM or SIGINT cancels it cleanly (130),
    and a lorabus error is printed as one line (1), not as a traceback.
    ``loop_factory``: the event loop to run it on (None: asyncio's)."""

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
            _exit_anyway_after(EXIT_GRACE_S, EXIT_INTERRUPTED)
            return EXIT_INTERRUPTED
        except LorabusError as exc:
            click.echo(f"error: {exc}", err=True)
            return EXIT_FAILED

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(guarded())


def _exit_anyway_after(grace_s: float, code: int) -> None:
    """Leave with ``code`` if the process is still here ``grace_s`` from now.

    Called once the command's clean-up ran (engines resumed, connections
    closed): what may still hold the process then (a task that outlives its
    cancellation, a worker thread the interpreter joins at exit) must not
    keep a stopped process alive; a supervisor that sent SIGTERM waits for
    it to go."""

    def watch() -> None:
        time.sleep(grace_s)
        log.warning("still here %.0f s after being stopped: leaving anyway", grace_s)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        os._exit(code)

    threading.Thread(target=watch, name="lorabus-exit-watch", daemon=True).start()
