"""Identities and permissions: the roles and their NATS permissions, the
accounts that keep them apart, ``lorabus auth init``'s configuration (static
users or operator JWTs), and signed commands and records. Internal: not
part of the public API (see ``lorabus``)."""
