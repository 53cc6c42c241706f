"""Minting NATS JWTs for the ``.creds`` tests, where ``nsc`` cannot be installed.

An operator-managed deployment gives each user a ``.creds`` file: a user JWT
signed by its account's nkey, and the user's nkey seed. These helpers write
the same (claims as NATS JWT v2 has them, ed25519 signatures by ``nkeys``)
and the ``operator`` / ``resolver: MEMORY`` server configuration that trusts
them, so that ``--creds`` is tested against a real nats-server.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


@dataclass(frozen=True)
class Key:
    seed: bytes
    public: str

    @classmethod
    def new(cls, prefix: int) -> Key:
        seed = bytes(nkeys.encode_seed(os.urandom(32), prefix))
        pair = nkeys.from_seed(bytearray(seed))
        return cls(seed, bytes(pair.public_key).decode())

    def sign(self, data: bytes) -> bytes:
        return bytes(nkeys.from_seed(bytearray(self.seed)).sign(data))


def _jwt(issuer: Key, subject: str, name: str, nats: dict[str, Any]) -> str:
    claims: dict[str, Any] = {
        "iat": int(time.time()),
        "iss": issuer.public,
        "name": name,
        "sub": subject,
        "nats": {**nats, "version": 2},
    }
    digest = hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    signature = _b64(issuer.sign(f"{header}.{body}".encode()))
    return f"{header}.{body}.{signature}"


@dataclass(frozen=True)
class Account:
    operator: Key
    key: Key
    operator_jwt: str
    account_jwt: str
    system: Key
    system_jwt: str
    """JetStream needs a system account in operator mode."""

    @classmethod
    def new(cls, name: str) -> Account:
        operator = Key.new(nkeys.PREFIX_BYTE_OPERATOR)
        account = Key.new(nkeys.PREFIX_BYTE_ACCOUNT)
        unlimited = {
            "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
            "wildcards": True, "conn": -1, "leaf": -1,
            "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
        }  # fmt: skip
        system = Key.new(nkeys.PREFIX_BYTE_ACCOUNT)
        return cls(
            operator,
            account,
            _jwt(operator, operator.public, "operator", {"type": "operator"}),
            _jwt(operator, account.public, name, {"type": "account", "limits": unlimited}),
            system,
            _jwt(operator, system.public, "SYS", {"type": "account"}),
        )

    def server_conf(self) -> str:
        return (
            f"operator: {self.operator_jwt}\n"
            f"system_account: {self.system.public}\n"
            "resolver: MEMORY\n"
            "resolver_preload: {\n"
            f"  {self.account.public}: {self.account_jwt}\n"
            f"  {self.system.public}: {self.system_jwt}\n"
            "}\n"
        )

    @property
    def account(self) -> Key:
        return self.key

    def creds(self, path: Path, name: str, publish: list[str], subscribe: list[str]) -> Path:
        """A ``.creds`` file of a new user of this account with these permissions."""
        user = Key.new(nkeys.PREFIX_BYTE_USER)
        token = _jwt(
            self.key,
            user.public,
            name,
            {
                "type": "user",
                "pub": {"allow": publish},
                "sub": {"allow": subscribe},
                "subs": -1,
                "data": -1,
                "payload": -1,
            },
        )
        path.write_text(
            "-----BEGIN NATS USER JWT-----\n"
            f"{token}\n"
            "------END NATS USER JWT------\n\n"
            "-----BEGIN USER NKEY SEED-----\n"
            f"{user.seed.decode()}\n"
            "------END USER NKEY SEED------\n"
        )
        path.chmod(0o600)
        return path
