"""How a process proves who it is to NATS, and how its link is protected.

One identity per connection, by exactly one of: a ``.creds`` file (a user
JWT and its nkey seed, from an operator-managed NATS account), an nkey seed
file, a user with a password, or a token. TLS adds a CA (to check the
server), and a client certificate and key (mutual TLS, which can also map a
certificate to a user). Secrets are read at connect time from files or from
environment variables, never from arguments, and :class:`BusOptions` holds
only where to find them, so printing it shows none.

Every command and ``UpdateClient.connect`` take the same options; each has a
``LORABUS_*`` environment variable (:meth:`BusOptions.from_env`). Two rules
protect a fleet from a careless set-up: credentials never go over plain
``nats://`` to a host that is not loopback, and a connection without any
credentials is made only to a loopback server (with a warning); ``insecure``
lifts both.

The inbox prefix keeps replies to one identity from being readable by
another: with an nkey seed it defaults to ``_INBOX_`` and the first 16
characters of the public key, which is what ``lorabus auth init`` permits.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import ssl
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from lorabus.errors import InsecureConnection

log = logging.getLogger(__name__)

ENV_FILE = "lorabus.env"
"""An identity folder's variables (``lorabus --identity DIR``)."""
PASSWORD_ENV = "LORABUS_NATS_PASSWORD"
TOKEN_ENV = "LORABUS_NATS_TOKEN"
INBOX_PREFIX_KEY_CHARS = 16

#: The environment variable of each option (the secrets have no option at all).
ENV = {
    "creds_file": "LORABUS_NATS_CREDS",
    "nkey_seed_file": "LORABUS_NATS_NKEY",
    "user": "LORABUS_NATS_USER",
    "tls_ca_file": "LORABUS_TLS_CA",
    "tls_cert_file": "LORABUS_TLS_CERT",
    "tls_key_file": "LORABUS_TLS_KEY",
    "inbox_prefix": "LORABUS_INBOX_PREFIX",
    "js_api_prefix": "LORABUS_JS_API_PREFIX",
    "insecure": "LORABUS_INSECURE",
}
_TRUE = {"1", "true", "yes", "on"}


class BusOptions(msgspec.Struct, frozen=True, kw_only=True):
    creds_file: str | None = None
    """A ``.creds`` file: the user JWT and nkey seed of an operator-managed account."""
    nkey_seed_file: str | None = None
    """A file holding an nkey seed (``SU...``), as ``lorabus auth init`` writes them."""
    user: str | None = None
    """A user name; its password comes from ``$LORABUS_NATS_PASSWORD``."""
    tls_ca_file: str | None = None
    """The CA that signed the server's certificate (default: the system's)."""
    tls_cert_file: str | None = None
    """The client certificate, for mutual TLS (with ``tls_key_file``)."""
    tls_key_file: str | None = None
    inbox_prefix: str | None = None
    """Where replies to this identity arrive; default ``_INBOX`` (see above)."""
    js_api_prefix: str | None = None
    """Where this identity's account has the fleet's JetStream API (``lorabus auth
    init`` imports it under ``JS.FLEET.API`` for every role but the
    coordinator); default ``$JS.API``."""
    insecure: bool = False
    """Allow credentials over plain ``nats://``, or no credentials, to a host
    that is not loopback."""

    def __post_init__(self) -> None:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("a TLS client certificate needs its key, and a key its certificate")
        for name in (
            "creds_file",
            "nkey_seed_file",
            "tls_ca_file",
            "tls_cert_file",
            "tls_key_file",
        ):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name.replace('_', ' ')} {path!r} is not a readable file")

    @classmethod
    def of_identity(cls, folder: Path) -> BusOptions:
        """The options of an identity folder that ``lorabus auth init`` wrote."""
        return cls.from_env(identity_env(folder))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **given: Any) -> BusOptions:
        """The options of the ``LORABUS_*`` variables, overridden by ``given``."""
        values: dict[str, Any] = {}
        for name, variable in ENV.items():
            raw = environ.get(variable)
            if raw:
                values[name] = raw.strip().lower() in _TRUE if name == "insecure" else raw
        values.update({name: value for name, value in given.items() if value is not None})
        return cls(**values)

    def nats_kwargs(
        self, servers: list[str], environ: Mapping[str, str] = os.environ
    ) -> dict[str, Any]:
        """The keyword arguments of nats-py's ``connect`` for this identity, after
        checking that the link protects it (raises :class:`InsecureConnection`)."""
        kwargs: dict[str, Any] = {}
        methods = []
        if self.creds_file:
            kwargs["user_credentials"] = self.creds_file
            methods.append("a .creds file")
        if self.nkey_seed_file:
            kwargs["nkeys_seed"] = self.nkey_seed_file
            methods.append("an nkey seed")
        if self.user:
            password = environ.get(PASSWORD_ENV)
            if not password:
                raise ValueError(f"user {self.user!r} needs its password in ${PASSWORD_ENV}")
            kwargs["user"], kwargs["password"] = self.user, password
            methods.append("a user and password")
        token = environ.get(TOKEN_ENV)
        if token:
            kwargs["token"] = token
            methods.append(f"a token (${TOKEN_ENV})")
        if len(methods) > 1:
            raise ValueError(f"give one way to authenticate, not {' and '.join(methods)}")
        tls = self.tls_context(servers)
        if tls is not None:
            kwargs["tls"] = tls
        prefix = self.inbox_prefix or self._derived_inbox_prefix()
        if prefix:
            kwargs["inbox_prefix"] = prefix
        in_url = _has_userinfo(servers)
        if in_url:
            log.warning(
                "a password in the NATS URL is visible to every user of this machine: "
                "use --nats-user and $%s instead",
                PASSWORD_ENV,
            )
        self._check_link(servers, credentials=bool(methods) or in_url, tls=tls)
        return kwargs

    def tls_context(self, servers: list[str]) -> ssl.SSLContext | None:
        """A TLS context when TLS is asked for (a CA, a client certificate, or a
        ``tls://`` URL); None for plain connections."""
        wanted = self.tls_ca_file or self.tls_cert_file or any(_scheme(s) == "tls" for s in servers)
        if not wanted:
            return None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca_file)
        if self.tls_cert_file and self.tls_key_file:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return context

    def _derived_inbox_prefix(self) -> str | None:
        if not self.nkey_seed_file:
            return None
        return inbox_prefix_for(public_key_of(Path(self.nkey_seed_file).read_bytes()))

    def _check_link(
        self, servers: list[str], *, credentials: bool, tls: ssl.SSLContext | None
    ) -> None:
        remote = sorted({_host(s) for s in servers if not _is_loopback(_host(s))})
        if self.insecure or not remote:
            if not credentials:
                _warn_once(
                    "connecting to NATS without credentials: anyone who reaches the "
                    "server can command the fleet (see lorabus auth init)"
                )
            return
        if credentials and tls is None:
            raise InsecureConnection(
                f"credentials would cross the network in the clear to {', '.join(remote)}: "
                "use TLS (a tls:// URL or --tls-ca), or --insecure to allow it"
            )
        if not credentials:
            raise InsecureConnection(
                f"no credentials for NATS at {', '.join(remote)}: anyone who reaches it "
                "could command the fleet; give credentials, or --insecure to allow it"
            )


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """Once per process: a process with many connections (a benchmark's agent
    host) would otherwise repeat it for each."""
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def identity_env(folder: Path) -> dict[str, str]:
    """The variables of an identity folder's ``lorabus.env`` (paths, no secrets)."""
    values = {}
    for line in (folder / ENV_FILE).read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith("#"):
            values[name.strip()] = value.strip()
    return values


def public_key_of(seed: bytes) -> str:
    """The public key of an nkey seed (the seed itself never leaves this call)."""
    import nkeys

    keys = nkeys.from_seed(bytearray(seed.strip()))
    try:
        return bytes(keys.public_key).decode()
    finally:
        keys.wipe()


def inbox_prefix_for(public_key: str) -> str:
    """The inbox prefix of the identity with ``public_key`` (see the module docstring)."""
    return f"_INBOX_{public_key[:INBOX_PREFIX_KEY_CHARS]}"


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "nats"


def _host(url: str) -> str:
    parsed = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
    return (parsed.hostname or "").lower()


def _has_userinfo(servers: list[str]) -> bool:
    return any("@" in url.split("://", 1)[-1].split("/", 1)[0] for url in servers)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
