"""The agent's settings, validated in one place.

The CLI's options, the process command lines the testbed builds and the
embedded stack all take their defaults from here.
"""

from __future__ import annotations

import os

import msgspec

from lorabus.bus.connect import redact
from lorabus.schemas import MAX_WORLD_SIZE, WorkerRole, check_token
from lorabus.schemas.bounds import MAX_SECONDS, parse_labels

ENGINE_KINDS = ("dynamo", "vllm", "sglang")
"""The engines an agent can drive (``--engine``); :mod:`lorabus.agents.engines`
maps each to its driver."""
ENGINE_TIMEOUT_S = 30.0
"""Seconds one engine HTTP call may take (a driver built without a config uses it too)."""
ENGINE_CONNECT_TIMEOUT_S = 5.0
"""Seconds a call may take to connect to its engine, the name lookup and TLS
included (at most the call's own timeout). The engine is beside its agent: a
connection that takes longer hangs (a lookup a DNS server dropped, a SYN a
full accept queue dropped), and is tried again within the phase's budget
instead of taking all of it. A lookup that hangs keeps its thread of the
event loop's default executor until the resolver gives up (glibc: 5 s a
try), so a stalled resolver costs a few threads for a few seconds."""
MAX_PAUSE_LEASE_S = 300.0
"""The longest pause lease an agent grants by default, whatever a command asks."""
MIN_PAUSE_LEASE_S = 0.5
"""The shortest: a command cannot make an agent resume in the middle of a load."""


MAX_ADAPTER_BYTES = 64 << 30
"""An adapter larger than this is no adapter: a fetch stops before reading it."""


def default_cache_dir(fleet: str) -> str:
    """``$XDG_CACHE_HOME/lorabus/adapters/<fleet>``, else
    ``~/.cache/lorabus/adapters/<fleet>``: shared by the agents of one fleet on
    the node, none of another fleet's (whose prunes follow their own
    ``--keep``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lorabus", "adapters", check_token("fleet", fleet))


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    fleet: str
    worker_id: str
    """Stable identity: a subject token, and the key that orders the rank map."""
    system_url: str
    """Base URL of the engine's control API (a Dynamo worker's system server, a
    vLLM or SGLang server)."""
    engine: str = "dynamo"
    """Which engine driver talks to ``system_url``: one of ``ENGINE_KINDS``."""
    world_size: int = 1
    """The engine's world size (tensor x pipeline parallel)."""
    heartbeat_s: float = 1.0
    """Seconds between heartbeats; the coordinator counts a member live for three."""
    engine_timeout_s: float = ENGINE_TIMEOUT_S
    max_pause_lease_s: float = MAX_PAUSE_LEASE_S
    """Resume on its own after this long paused without a renewal, whatever lease
    the coordinator asked for."""
    coordinator_keys: list[str] = []
    """Obey only commands signed by the leader with one of these public keys."""
    trust_file: str = ""
    """With no key given: trust the first leader key seen, recorded in this file.
    With neither, commands are not checked for signatures."""
    adapter_roots: list[str] = []
    """If set, load adapters only from directories under these, checked on this
    host after resolving symlinks."""
    headers: dict[str, str] = {}
    """Sent with every engine call (auth)."""
    admin_headers: dict[str, str] = {}
    """Sent on the engine's control routes (pause, resume, load, unload) in place
    of the same-named ``headers``: the key of SGLang's ``--admin-api-key``,
    which those routes take instead of its ``--api-key``. SGLang only."""
    subject_prefix: str = "lorabus"
    cache_dir: str = ""
    """Where adapters from the fleet's object store are kept on this node
    ("": :func:`default_cache_dir`, one per fleet). Agents of one node, of
    one fleet or several, may share it."""
    cache_keep: int = 2
    """Adapters a prune keeps in the cache, the most recently used, besides
    those an engine of the node serves (of any agent sharing the cache)."""
    max_adapter_bytes: int = MAX_ADAPTER_BYTES
    """The largest adapter this agent fetches from the object store."""
    max_adapters: int = 0
    """The most adapters the engine holds at once (vLLM's ``--max-cpu-loras``,
    Dynamo's per worker; SGLang says its own, and the smaller counts): a load
    beyond unloads the oldest versions nothing keeps, or fails
    ``no_capacity``. 0: as the engine says, else not bounded."""
    role: WorkerRole = WorkerRole.AGGREGATED
    """What the worker does in serving: both phases, or disaggregated serving's
    prefill or decode (each loads the adapter; a Dynamo canary is routed to
    the worker in its role)."""
    frontend_url: str = ""
    """Dynamo: the frontend the canary generates through, routed to this
    worker ("": a canary fails, saying so; vLLM and SGLang generate at
    ``system_url``)."""
    frontend_discovery_url: str = ""
    """Dynamo: where the frontend serves ``/v1/rl/workers`` (its RL port),
    which gives this worker's instance id ("": ``frontend_url``)."""
    labels: list[str] = []
    """``KEY=VALUE`` labels the heartbeat announces (``zone=us-east-1a``,
    ``gpu=h100``): an update's selector places adapters by them."""

    def __post_init__(self) -> None:
        check_token("worker id", self.worker_id)
        check_token("fleet", self.fleet)
        if self.engine not in ENGINE_KINDS:
            raise ValueError(
                f"unknown engine {self.engine!r}: use one of {', '.join(ENGINE_KINDS)}"
            )
        if self.heartbeat_s < 0.05:
            raise ValueError(f"heartbeat interval must be >= 0.05s, got {self.heartbeat_s}")
        if self.engine_timeout_s < 0.1:
            raise ValueError(f"engine timeout must be >= 0.1s, got {self.engine_timeout_s}")
        if not MIN_PAUSE_LEASE_S <= self.max_pause_lease_s <= MAX_SECONDS:
            raise ValueError(
                f"max pause lease must be {MIN_PAUSE_LEASE_S}-{MAX_SECONDS:.0f}s, "
                f"got {self.max_pause_lease_s}"
            )
        if not 1 <= self.world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world size must be 1-{MAX_WORLD_SIZE}, got {self.world_size}")
        check_engine_url(self.system_url)
        if self.admin_headers and self.engine != "sglang":
            raise ValueError(
                f"an admin key is for SGLang's --admin-api-key; {self.engine} has none "
                "(give its key with --api-key-env)"
            )
        if self.role not in set(WorkerRole):
            roles = ", ".join(WorkerRole)
            raise ValueError(f"unknown role {self.role!r}: use one of {roles}")
        for url in (self.frontend_url, self.frontend_discovery_url):
            if url:
                check_engine_url(url)
        if (self.frontend_url or self.frontend_discovery_url) and self.engine != "dynamo":
            raise ValueError(
                f"a frontend URL is for a Dynamo worker's canary; {self.engine} generates "
                "at its own --system-url"
            )
        if self.frontend_discovery_url and not self.frontend_url:
            raise ValueError("--frontend-discovery-url needs --frontend-url")
        if self.cache_keep < 0:
            raise ValueError(f"cache keep must be >= 0, got {self.cache_keep}")
        if self.max_adapters < 0:
            raise ValueError(f"max adapters must be >= 0, got {self.max_adapters}")
        if self.max_adapter_bytes < 1:
            raise ValueError(f"max adapter bytes must be >= 1, got {self.max_adapter_bytes}")
        parse_labels(self.labels)

    @property
    def label_map(self) -> dict[str, str]:
        return parse_labels(self.labels)


def check_engine_url(url: str) -> None:
    """Refuse an engine URL the HTTP client cannot use (shown without its password)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"system URL {redact(url)!r} must start with http:// or https://")
    if not url.isascii():
        raise ValueError(
            f"system URL {redact(url)!r} must be ASCII (an international "
            "host name in its xn-- form, other characters percent-encoded)"
        )
