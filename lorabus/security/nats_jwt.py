"""NATS JWTs (v2) and ``.creds`` files, signed with nkeys.

What ``nsc`` writes for an operator-managed deployment: an operator key that
signs account JWTs, account keys that sign user JWTs, and per user a
``.creds`` file (its JWT and its nkey seed). ``lorabus auth init --method jwt``
writes a fleet's this way, so that it runs on a server that trusts the
operator (or is imported into an existing ``nsc`` setup) with the same
accounts and permissions as the static configuration.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import nkeys


@dataclass(frozen=True)
class Key:
    """An nkey pair: its seed (secret) and its public key."""

    seed: bytes
    public: str

    @classmethod
    def new(cls, prefix: int) -> Key:
        return cls.from_seed(bytes(nkeys.encode_seed(os.urandom(32), prefix)))

    @classmethod
    def from_seed(cls, seed: bytes) -> Key:
        seed = seed.strip()
        pair = nkeys.from_seed(bytearray(seed))
        try:
            return cls(seed, bytes(pair.public_key).decode())
        finally:
            pair.wipe()

    def sign(self, data: bytes) -> bytes:
        pair = nkeys.from_seed(bytearray(self.seed))
        try:
            return bytes(pair.sign(data))
        finally:
            pair.wipe()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def encode(issuer: Key, subject: str, name: str, nats: dict[str, Any]) -> str:
    """A JWT of ``subject`` (a public key) signed by ``issuer``, with the
    ``nats`` claims of its type (``operator``, ``account`` or ``user``)."""
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


def creds(user_jwt: str, user: Key) -> bytes:
    """A ``.creds`` file's content: the user's JWT and its nkey seed."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{user_jwt}\n"
        "------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{user.seed.decode()}\n"
        "------END USER NKEY SEED------\n"
    ).encode()
