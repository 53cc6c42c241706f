"""The operator/JWT form of a fleet's accounts (``lorabus auth init --method jwt``).

The same accounts, exports, imports and permissions as the static
configuration (:mod:`lorabus.security.accounts`, :mod:`lorabus.security.roles`), as NATS runs
them with decentralized authentication: an operator signs one JWT per
account, each account signs its users' JWTs, and each identity gets a
``.creds`` file. The server is given the operator, a system account
(JetStream needs one in operator mode) and the account JWTs preloaded
(``resolver: MEMORY``). The operator's and accounts' seeds are kept beside
the configuration (0600) to sign more users, or to import into ``nsc``.

Exports are not limited to named accounts here (that would take an
activation token per import): only the operator can add an account, and
only the accounts it signed can import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import nkeys

from lorabus.security.accounts import FleetAccounts
from lorabus.security.nats_jwt import Key, creds, encode
from lorabus.security.roles import Permissions

_UNLIMITED = {"subs": -1, "data": -1, "payload": -1}
_JETSTREAM = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
_ACCOUNT_LIMITS = {"imports": -1, "exports": -1, "wildcards": True, "conn": -1, "leaf": -1}


@dataclass(frozen=True)
class JwtAuthority:
    operator: Key
    system: Key
    accounts: dict[str, Key]
    """The key of each account, by its name in the layout."""

    @classmethod
    def create(cls, layout: FleetAccounts) -> JwtAuthority:
        return cls(
            Key.new(nkeys.PREFIX_BYTE_OPERATOR),
            Key.new(nkeys.PREFIX_BYTE_ACCOUNT),
            {name: Key.new(nkeys.PREFIX_BYTE_ACCOUNT) for name in layout.accounts},
        )

    def user_creds(self, account: str, name: str, allowed: Permissions, seed: bytes) -> bytes:
        """The ``.creds`` content of user ``name`` (nkey ``seed``) of ``account``."""
        user = Key.from_seed(seed)
        claims: dict[str, Any] = {
            "type": "user",
            "pub": {"allow": list(allowed.publish)},
            "sub": {"allow": list(allowed.subscribe)},
            **_UNLIMITED,
        }
        if allowed.allow_responses:
            claims["resp"] = {"max": 1, "ttl": 0}
        return creds(encode(self.accounts[account], user.public, name, claims), user)

    def server_conf(self, layout: FleetAccounts, *, jetstream_max_bytes: int) -> str:
        """The operator-mode part of ``nats-server.conf``; the fleet account's
        JetStream file storage is ``jetstream_max_bytes``."""
        preload = {
            self.system.public: encode(
                self.operator, self.system.public, "SYS", {"type": "account"}
            )
        }
        for name, account in layout.accounts.items():
            key = self.accounts[name]
            claims: dict[str, Any] = {
                "type": "account",
                "limits": {
                    **_UNLIMITED,
                    **_ACCOUNT_LIMITS,
                    **(
                        {**_JETSTREAM, "disk_storage": jetstream_max_bytes}
                        if account.jetstream
                        else {}
                    ),
                },
                "exports": [
                    {
                        "name": export.subject,
                        "subject": export.subject,
                        "type": "service" if export.service else "stream",
                        **({"response_type": "Stream"} if export.streamed else {}),
                    }
                    for export in account.exports
                ],
                "imports": [
                    {
                        "name": imported.subject,
                        "subject": imported.subject,
                        "account": self.accounts[imported.account].public,
                        "type": "service" if imported.service else "stream",
                        **({"local_subject": imported.local} if imported.local else {}),
                    }
                    for imported in account.imports
                ],
            }
            preload[key.public] = encode(self.operator, key.public, name, claims)
        operator = encode(self.operator, self.operator.public, "lorabus", {"type": "operator"})
        lines = [
            f"operator: {operator}",
            f"system_account: {self.system.public}",
            "resolver: MEMORY",
            "resolver_preload: {",
            *(f"  {public}: {token}" for public, token in preload.items()),
            "}",
        ]
        return "\n".join(lines) + "\n"

    def seeds(self) -> dict[str, bytes]:
        """The seeds to keep (file name to seed): the operator's and each account's."""
        kept = {"operator.seed": self.operator.seed, "system-account.seed": self.system.seed}
        kept |= {f"account-{name}.seed": key.seed for name, key in self.accounts.items()}
        return kept
