"""Minting NATS JWTs for the ``.creds`` tests, where ``nsc`` cannot be installed.

An operator-managed deployment gives each user a ``.creds`` file: a user JWT
signed by its account's nkey, and the user's nkey seed. These helpers write
the same (claims as NATS JWT v2 has them, ed25519 signatures by ``nkeys``)
and the ``operator`` / ``resolver: MEMORY`` server configuration that trusts
them, so that ``--creds`` is tested against a real nats-server.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import nkeys

from lorabus.security.nats_jwt import Key, creds, encode


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
            encode(operator, operator.public, "operator", {"type": "operator"}),
            encode(operator, account.public, name, {"type": "account", "limits": unlimited}),
            system,
            encode(operator, system.public, "SYS", {"type": "account"}),
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
        token = encode(
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
        path.write_bytes(creds(token, user))
        path.chmod(0o600)
        return path
