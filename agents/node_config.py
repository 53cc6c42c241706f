"""A node agent's settings: which workers it drives, from a small TOML file.

``lorabus agent --node-file node.toml`` drives every worker the file lists::

    node = "gpu-07"                  # the node's name: its identity, its subjects

    [defaults]                       # optional: settings every worker takes
    engine = "vllm"

    [[workers]]
    worker_id = "w000"
    system_url = "http://127.0.0.1:8000"
    world_size = 2
    api_key_env = "VLLM_API_KEY"     # the engine's key, as --api-key-env

Each worker takes any agent setting (the fields of
:class:`~lorabus.agents.config.AgentConfig`, by the names the table there
gives, ``-`` or ``_`` alike) plus ``api_key_env`` and
``admin_api_key_env``; what it leaves out it takes from ``[defaults]``, and
what that leaves out from the command line's flags.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from lorabus.agents.config import AgentConfig
from lorabus.schemas import MAX_NODE_WORKERS, check_token

_KEY_ENVS = ("api_key_env", "admin_api_key_env")
_OWN = ("worker_id", "system_url")
"""Settings of one worker alone: never defaults."""


class NodeConfig(msgspec.Struct, frozen=True):
    node: str
    """The node's name: a subject token, none of its workers' ids."""
    workers: list[AgentConfig]

    def __post_init__(self) -> None:
        check_token("node name", self.node)
        if not 1 <= len(self.workers) <= MAX_NODE_WORKERS:
            raise ValueError(f"a node drives 1-{MAX_NODE_WORKERS} workers, got {len(self.workers)}")
        ids = [worker.worker_id for worker in self.workers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"node {self.node!r} lists a worker twice")
        if self.node in ids:
            raise ValueError(f"node {self.node!r} has the name of one of its workers")
        if len({(w.fleet, w.subject_prefix) for w in self.workers}) != 1:
            raise ValueError(f"the workers of node {self.node!r} must be of one fleet")


def load_node_config(
    path: str,
    base: Mapping[str, Any],
    headers_of: Callable[[str | None], dict[str, str]],
    admin_headers_of: Callable[[str | None], dict[str, str]],
) -> NodeConfig:
    """The node ``path`` describes, each worker's settings over ``base`` (the
    command line's); ``headers_of(VAR)`` and ``admin_headers_of(VAR)``: the
    headers an engine key variable and an admin key variable make.
    ValueError, saying what is wrong and where, for anything else."""
    try:
        with open(path, "rb") as file:
            text = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"node file {path}: {exc}") from None
    unknown = set(text) - {"node", "defaults", "workers"}
    if unknown:
        raise ValueError(f"node file {path}: unknown key {sorted(unknown)[0]!r}")
    node = text.get("node")
    if not isinstance(node, str):
        raise ValueError(f'node file {path}: give the node\'s name (node = "...")')
    defaults = _settings(text.get("defaults", {}), f"{path} [defaults]")
    own = sorted(set(defaults) & set(_OWN))
    if own:
        raise ValueError(f"node file {path}: {own[0]} is one worker's, not a default")
    tables = text.get("workers")
    if not isinstance(tables, list) or not tables:
        raise ValueError(f"node file {path}: list its workers ([[workers]] tables)")
    workers = []
    for index, table in enumerate(tables):
        where = f"{path} worker {index + 1}"
        settings = {**base, **defaults, **_settings(table, where)}
        workers.append(_worker(settings, headers_of, admin_headers_of, where))
    try:
        return NodeConfig(node, workers)
    except ValueError as exc:
        raise ValueError(f"node file {path}: {exc}") from None


def _settings(table: Any, where: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ValueError(f"{where}: not a table")
    fields = {f.name for f in msgspec.structs.fields(AgentConfig)} - {"headers", "admin_headers"}
    settings = {key.replace("-", "_"): value for key, value in table.items()}
    unknown = sorted(set(settings) - fields - set(_KEY_ENVS))
    if unknown:
        raise ValueError(f"{where}: unknown setting {unknown[0]!r}")
    return settings


def _worker(
    settings: dict[str, Any],
    headers_of: Callable[[str | None], dict[str, str]],
    admin_headers_of: Callable[[str | None], dict[str, str]],
    where: str,
) -> AgentConfig:
    api_key_env = settings.pop("api_key_env", None)
    admin_key_env = settings.pop("admin_api_key_env", None)
    if api_key_env is not None:
        settings["headers"] = headers_of(api_key_env)
    if admin_key_env is not None:
        settings["admin_headers"] = admin_headers_of(admin_key_env)
    try:
        return msgspec.convert(settings, AgentConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
