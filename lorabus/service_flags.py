"""The serving processes' flags, each mapped to its config field, in one table.

``lorabus agent`` and ``lorabus coordinator`` take their options from these
tables, with the defaults of :class:`~lorabus.agents.AgentConfig` and
:class:`~lorabus.coordinator.CoordinatorConfig`; the testbed and the tests
build those processes' command lines from a config through the same tables
(:func:`agent_args`, :func:`coordinator_args`). A flag's name, its field and
its default are each written once, and a config that a command line cannot
express (a field without a flag, headers) is refused instead of dropped.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import click
import msgspec

from lorabus.agents.config import AgentConfig
from lorabus.agents.engines import ENGINE_KINDS
from lorabus.coordinator.config import CoordinatorConfig
from lorabus.schemas import Naming, UpdateMode, WorkerRole
from lorabus.schemas.nodes import NODES_ENV
from lorabus.schemas.tenants import TENANTS_ENV
from lorabus.security.signing import COORDINATOR_KEYS_ENV, SIGNING_KEY_ENV, TRUST_FILE_ENV

_Config = TypeVar("_Config", bound=msgspec.Struct)
_F = TypeVar("_F", bound=Callable[..., Any])


class QuorumType(click.ParamType):
    """``all`` or a fraction in (0, 1] of the expected world size."""

    name = "all|FRACTION"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, float):
            return value
        if value == "all":
            return 1.0
        try:
            fraction = float(value)
        except ValueError:
            fraction = -1.0
        if not 0 < fraction <= 1:
            self.fail("use 'all' or a fraction in (0, 1], e.g. 0.75", param, ctx)
        return fraction


@dataclass(frozen=True)
class Flag:
    field: str
    """The config field it sets."""
    name: str
    help: str
    type: Any = None
    """A click type; None for text."""
    multiple: bool = False
    envvar: str | None = None
    """Also read from this environment variable (an identity folder sets it)."""
    optional: bool = False
    """Not required by the command line, though the config requires it: given
    another way (an agent's workers by ``--node-file``), checked by the command."""

    def option(self, default: Any) -> Callable[[_F], _F]:
        required = default is msgspec.NODEFAULT and not self.optional
        unset = default is msgspec.NODEFAULT
        shown: bool | str = not unset and default not in (None, [], "")
        if shown and isinstance(self.type, QuorumType) and default == 1.0:
            shown = "all"
        # A required option gets no default at all: click 8.3+ counts an
        # explicit default=None as given, and no longer reports it missing.
        defaults = {} if unset else {"default": _as_option_value(default)}
        if self.type is bool:  # an on/off switch: --name and --no-name
            off = f"--no-{self.name.removeprefix('--')}"
            return click.option(
                f"{self.name}/{off}", self.field, default=default, show_default=True, help=self.help
            )
        return click.option(
            self.name,
            self.field,
            type=self.type,
            multiple=self.multiple,
            envvar=self.envvar,
            required=required,
            show_default=shown,
            help=self.help,
            **defaults,
        )

    def render(self, value: Any) -> list[str]:
        if self.type is bool:
            return [self.name if value else f"--no-{self.name.removeprefix('--')}"]
        if self.multiple:
            return [part for item in value for part in (self.name, str(item))]
        if isinstance(self.type, QuorumType) and value == 1.0:
            return [self.name, "all"]
        if self.type is int:
            return [self.name, str(int(value))]
        return [self.name, str(value.value if isinstance(value, enum.Enum) else value)]


AGENT_FLAGS = (
    Flag(
        "worker_id",
        "--worker-id",
        "Stable identity; orders the rank map (required unless --node-file).",
        optional=True,
    ),
    Flag("engine", "--engine", "The engine kind at --system-url.", click.Choice(ENGINE_KINDS)),
    Flag(
        "system_url",
        "--system-url",
        "The worker's system server base URL (required unless --node-file).",
        optional=True,
    ),
    Flag("world_size", "--world-size", "The engine's world size (tensor x pipeline).", int),
    Flag("heartbeat_s", "--heartbeat-s", "Seconds between heartbeats.", float),
    Flag("engine_timeout_s", "--engine-timeout", "Seconds for one engine HTTP call.", float),
    Flag(
        "max_pause_lease_s",
        "--max-pause-lease",
        "Resume the engine on its own after this long paused without a renewal, "
        "whatever lease the coordinator asked for.",
        float,
    ),
    Flag(
        "coordinator_keys",
        "--coordinator-key",
        "Obey only commands signed by the fleet's leader with this public key "
        "(repeatable; lorabus auth init writes it into each agent's identity).",
        multiple=True,
        envvar=COORDINATOR_KEYS_ENV,
    ),
    Flag(
        "trust_file",
        "--trust-file",
        "With no --coordinator-key: trust the first leader key seen, recorded in this file.",
        envvar=TRUST_FILE_ENV,
    ),
    Flag(
        "adapter_roots",
        "--adapter-root",
        "Load adapters only from directories under this one, checked on this host "
        "after resolving symlinks (repeatable).",
        multiple=True,
    ),
    Flag(
        "cache_dir",
        "--cache-dir",
        "Where adapters fetched from the fleet's object store are kept on this node "
        "(agents of one node, of one fleet or several, may share it: each adapter is "
        "fetched once, and none an engine of the node serves is pruned). "
        "Default: $XDG_CACHE_HOME/lorabus/adapters/<fleet>, "
        "else ~/.cache/lorabus/adapters/<fleet>.",
    ),
    Flag(
        "cache_keep",
        "--keep",
        "Adapters a prune keeps in the cache, the most recently used, besides those "
        "an engine of the node serves.",
        type=click.IntRange(min=0),
    ),
    Flag(
        "max_adapter_bytes",
        "--max-adapter-bytes",
        "The largest adapter fetched from the fleet's object store.",
        type=click.IntRange(min=1),
    ),
    Flag(
        "max_adapters",
        "--max-adapters",
        "The most adapters the engine holds at once (vLLM's --max-cpu-loras, Dynamo's "
        "per worker; SGLang's --max-loaded-loras is read from the engine, and the smaller "
        "counts): a load beyond unloads the oldest versions nothing keeps first, or fails "
        "no_capacity. 0: as the engine says, else not bounded.",
        type=click.IntRange(min=0),
    ),
    Flag(
        "role",
        "--role",
        "What the worker does in serving: both phases, or disaggregated serving's "
        "prefill or decode (Dynamo's prefill and decode workers each load the adapter).",
        click.Choice([r.value for r in WorkerRole]),
    ),
    Flag(
        "frontend_url",
        "--frontend-url",
        "Dynamo: the frontend's base URL; the canary generates through it, routed to "
        "this worker (vLLM and SGLang generate at --system-url).",
    ),
    Flag(
        "frontend_discovery_url",
        "--frontend-discovery-url",
        "Dynamo: where the frontend serves /v1/rl/workers (its RL port), which gives "
        "this worker's instance id. Default: --frontend-url.",
    ),
    Flag(
        "labels",
        "--label",
        "KEY=VALUE the worker announces in its heartbeat (zone=us-east-1a, gpu=h100; "
        "repeatable): an update's --selector places adapters by them.",
        multiple=True,
    ),
)

COORDINATOR_FLAGS = (
    Flag("frontend_url", "--frontend-url", "Dynamo frontend base URL."),
    Flag(
        "expected_world_size",
        "--expected-world-size",
        "Sum of the workers' world sizes an update waits for.",
        int,
    ),
    Flag("phase_timeout_s", "--phase-timeout", "Seconds for every member to ack a phase.", float),
    Flag(
        "prepare_timeout_s",
        "--prepare-timeout",
        "Seconds for every member to fetch an adapter from the fleet's object store.",
        float,
    ),
    Flag(
        "verify_timeout_s",
        "--verify-timeout",
        "Seconds for the frontend to list the new adapter.",
        float,
    ),
    Flag(
        "quorum_timeout_s",
        "--quorum-timeout",
        "Seconds for live world sizes to reach the expected sum.",
        float,
    ),
    Flag(
        "quorum",
        "--quorum",
        "'all', or the fraction of the expected world size an update needs; below "
        "all, workers that fail are left out of the commit and its rank map.",
        QuorumType(),
    ),
    Flag("keep", "--keep", "Versions of an adapter kept loaded after a commit.", int),
    Flag(
        "canary",
        "--canary",
        "Before a commit, every member's engine and the frontend generate one token "
        "with the new served name (after the resume in pause mode); --no-canary turns "
        "it off for the fleet.",
        bool,
    ),
    Flag(
        "orphan_after_s",
        "--orphan-after",
        "Seconds after which an object of the store that nothing keeps (pushed and "
        "never committed, or the chunks of a push that stopped) is deleted, at a later "
        "commit; keep it above the longest push.",
        float,
    ),
    Flag(
        "replace_after_s",
        "--replace-after",
        "Seconds a worker an adapter is placed on may be silent before the adapter moves "
        "to another (a restart within it moves nothing).",
        float,
    ),
    Flag(
        "signing_key_file",
        "--signing-key",
        "An nkey seed file: sign every command with it (lorabus auth init writes one "
        "into the coordinator's identity).",
        envvar=SIGNING_KEY_ENV,
    ),
    Flag(
        "max_queued",
        "--max-queued",
        "Update requests of one adapter that may wait; more are answered busy.",
        int,
    ),
    Flag(
        "max_queued_total",
        "--max-queued-total",
        "Update requests that may wait in all, of every adapter; more are answered busy.",
        int,
    ),
    Flag(
        "max_concurrent",
        "--max-concurrent",
        "Updates of different adapters that may run at once (pause-mode ones in rounds "
        "that share one pause of the fleet).",
        int,
    ),
    Flag(
        "tenants_file",
        "--tenants",
        "A tenants file (lorabus auth init --tenant writes one into the coordinator's "
        "identity): each tenant asks on subjects of its own, for its own adapters, "
        "within its quotas.",
        envvar=TENANTS_ENV,
    ),
    Flag(
        "nodes_file",
        "--nodes",
        "A nodes file (lorabus auth init --node writes one into the coordinator's "
        "identity): a node agent's acks and beats count only for its own workers.",
        envvar=NODES_ENV,
    ),
    Flag("naming", "--naming", "Served names.", click.Choice([n.value for n in Naming])),
    Flag(
        "mode",
        "--mode",
        "How updates run unless a request says: pause (the fleet pauses around the "
        "load) or live (nothing pauses: the new versioned name is loaded beside the "
        "served one).",
        click.Choice([m.value for m in UpdateMode]),
    ),
    Flag(
        "adapter_roots",
        "--adapter-root",
        "Accept adapter paths only under this directory (repeatable).",
        multiple=True,
    ),
    Flag(
        "pause_lease_s",
        "--pause-lease",
        "Seconds an agent stays paused without a renewal before resuming on its own.",
        float,
    ),
    Flag(
        "leader_lease_s",
        "--leader-lease",
        "Seconds of silence after which a standby coordinator takes over.",
        float,
    ),
    Flag("holder", "--holder", "This coordinator's name (default: host-pid-random)."),
    Flag(
        "kv_replicas",
        "--kv-replicas",
        "Replicas of the fleet's KV buckets (3 on a three-node NATS cluster).",
        int,
    ),
    Flag("audit_max_age_s", "--audit-max-age", "Seconds the audit stream keeps records.", float),
    Flag(
        "audit_max_bytes",
        "--audit-max-bytes",
        "Bytes the audit stream may hold before dropping its oldest records.",
        int,
    ),
    Flag(
        "adapter_store_max_bytes",
        "--adapter-store-max-bytes",
        "Bytes the fleet's adapter object store may hold; a push beyond is refused, "
        "and the fleet's KV buckets keep the rest of JetStream's storage "
        "(-1: no limit of its own, not advised).",
        int,
    ),
)


def config_options(config_type: type[_Config], flags: Sequence[Flag]) -> Callable[[_F], _F]:
    """Click options for ``flags``, with the defaults of ``config_type``."""
    defaults = _defaults(config_type)

    def decorate(command: _F) -> _F:
        for flag in reversed(flags):
            command = flag.option(defaults[flag.field])(command)
        return command

    return decorate


def build_config(
    config_type: type[_Config], flags: Sequence[Flag], values: Mapping[str, Any], **fixed: Any
) -> _Config:
    """The config from a command's option values (plus ``fixed`` fields); a
    value the config refuses is a usage error."""
    fields: dict[str, Any] = {f.field: values[f.field] for f in flags}
    for flag in flags:
        if flag.multiple:
            fields[flag.field] = list(fields[flag.field])
    if "naming" in fields:
        fields["naming"] = Naming(fields["naming"])
    if "mode" in fields:
        fields["mode"] = UpdateMode(fields["mode"])
    try:
        return config_type(**fields, **fixed)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def agent_args(config: AgentConfig, *, nats_url: str, extra: Sequence[str] = ()) -> list[str]:
    """``agent --nats ... --fleet ...`` and a flag for every setting of ``config``
    that differs from the default; ``extra`` (auth, metrics) goes last."""
    return ["agent", *_args(config, AGENT_FLAGS, nats_url), *extra]


def coordinator_args(
    config: CoordinatorConfig, *, nats_url: str, extra: Sequence[str] = ()
) -> list[str]:
    """The same for ``coordinator``."""
    return ["coordinator", *_args(config, COORDINATOR_FLAGS, nats_url), *extra]


def _args(config: AgentConfig | CoordinatorConfig, flags: Sequence[Flag], url: str) -> list[str]:
    if config.headers or getattr(config, "admin_headers", None):
        raise ValueError(
            "headers carry secrets and stay off command lines: pass --api-key-env VAR, "
            "--admin-api-key-env VAR (agents) or --header NAME=VALUE in extra"
        )
    by_field = {flag.field: flag for flag in flags}
    args = ["--nats", url, "--fleet", config.fleet]
    for name, default in _defaults(type(config)).items():
        value = getattr(config, name)
        flag = by_field.get(name)
        if name in ("fleet", "headers", "admin_headers"):
            continue
        if flag is None:
            if value != default:
                raise ValueError(f"{name}={value!r} has no command-line flag")
            continue
        if default is msgspec.NODEFAULT or value != default:
            args += flag.render(value)
    return args


def _defaults(config_type: type[msgspec.Struct]) -> dict[str, Any]:
    """Each field's default (``msgspec.NODEFAULT`` for a required one)."""
    defaults: dict[str, Any] = {}
    for info in msgspec.structs.fields(config_type):
        if info.default_factory is not msgspec.NODEFAULT:
            defaults[info.name] = info.default_factory()
        else:
            defaults[info.name] = info.default
    return defaults


def _as_option_value(default: Any) -> Any:
    if isinstance(default, enum.Enum):
        return default.value
    if isinstance(default, list):
        return tuple(default)
    return default
