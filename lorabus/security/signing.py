"""Signed commands: the leading coordinator signs, agents check before acting.

Server permissions decide who may publish on a command subject; a signature
decides whether an agent obeys what arrives there, so one misconfigured
permission or one compromised peer with publish rights cannot drive engines.

The coordinator holds an ed25519 key (an nkey seed file). Each command it
sends carries two NATS headers: ``Lorabus-Seq``, a number that grows with
every command this process sends, and ``Lorabus-Sig``, the signature over the
subject, that number and the body (which holds the epoch and the update id).
The leader record in the fleet's KV names the leader's public key. An agent
pinned to the fleet's coordinator keys (``--coordinator-key``, or trusted on
first use and recorded in ``--trust-file``) acts on a command only if the key
of the leader record of the command's epoch is pinned, the signature checks
out for the subject it arrived on, and its sequence number is above the last
one that agent took in that epoch (publishes of one connection arrive in
order). Anything else is refused with a ``command_refused`` event: unsigned,
signed by another key, moved onto another subject, or replayed.

The same key seals the fleet's state records in KV (the leader record, the
committed and in-flight records, resets and results): a sealed record holds
the record's JSON, the signing public key and the signature over the KV key
and that JSON. An agent pinned to the fleet's keys, and every coordinator
with the signing key, acts only on records sealed by a key it trusts (a
record moved to another key does not verify); anything else is treated as
garbage, which the coordinators replace and the agents ignore and report.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec
import nacl.exceptions
import nacl.signing
import nkeys

from lorabus.errors import BadRequest

log = logging.getLogger(__name__)

SIGNING_KEY_ENV = "LORABUS_SIGNING_KEY_FILE"
COORDINATOR_KEYS_ENV = "LORABUS_COORDINATOR_KEYS"
"""Whitespace-separated public keys (an agent identity's ``lorabus.env`` sets it)."""
TRUST_FILE_ENV = "LORABUS_TRUST_FILE"

SEQ_HEADER = "Lorabus-Seq"
SIG_HEADER = "Lorabus-Sig"

_PROVEN_KEPT = 64
_proven: OrderedDict[tuple[str, bytes, bytes], None] = OrderedDict()
"""(key, SHA-256 of the signed bytes, signature) of signatures this process
checked and found good, newest last: agents that share a process (a test, a
bench host) receive the same broadcast bytes, and an ed25519 check (about
70 us) gives the same answer for the same input. Each agent still applies its
own replay check; a failed check is never remembered."""


def new_signing_seed() -> bytes:
    """A fresh nkey seed for signing commands (an account-type key, ``SA...``)."""
    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT))


def _signed_bytes(subject: str, seq: int, body: bytes) -> bytes:
    return b"%s\n%d\n%s" % (subject.encode(), seq, body)


class SealedRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A fleet state record as a signing coordinator stores it."""

    record: msgspec.Raw
    """The record's JSON, exactly as signed."""
    key: str
    """The public key that signed it."""
    sig: str
    """Base64 of the signature over the KV key and ``record``."""


_SEALED = msgspec.json.Decoder(SealedRecord)


def _sealed_bytes(name: str, record: bytes) -> bytes:
    # A domain of its own: no command signature is ever a record's, or back.
    return b"lorabus-record\n%s\n%s" % (name.encode(), record)


class CommandSigner:
    """Signs this coordinator's commands with the seed in ``seed_file``."""

    def __init__(self, seed: bytes) -> None:
        keys = nkeys.from_seed(bytearray(seed.strip()))
        try:
            self.public_key = bytes(keys.public_key).decode()
            raw = nkeys.decode_seed(bytearray(seed.strip()))[1]
        finally:
            keys.wipe()
        self._key = nacl.signing.SigningKey(bytes(raw))
        self._seq = 0

    @classmethod
    def from_file(cls, path: str | Path) -> CommandSigner:
        try:
            seed = Path(path).read_bytes()
        except OSError as exc:
            raise BadRequest(f"cannot read the signing key {str(path)!r}: {exc.strerror}") from exc
        try:
            return cls(seed)
        except (nkeys.NkeysError, binascii.Error, ValueError) as exc:
            raise BadRequest(f"{str(path)!r} holds no nkey seed: {exc}") from None

    def seal(self, name: str, record: bytes) -> bytes:
        """``record`` (JSON) sealed for the KV key ``name``."""
        signature = self._key.sign(_sealed_bytes(name, record)).signature
        sealed = SealedRecord(
            record=msgspec.Raw(record),
            key=self.public_key,
            sig=base64.b64encode(signature).decode(),
        )
        return msgspec.json.encode(sealed)

    def headers(self, subject: str, body: bytes) -> dict[str, str]:
        self._seq += 1
        signature = self._key.sign(_signed_bytes(subject, self._seq, body)).signature
        return {SEQ_HEADER: str(self._seq), SIG_HEADER: base64.b64encode(signature).decode()}


class CommandVerifier:
    """One agent's check of signed commands.

    ``pinned``: the coordinator public keys this agent obeys. ``trust_file``:
    when no key is pinned, the first leader key seen is recorded there and
    pinned from then on (trust on first use). With neither, nothing is checked.
    """

    def __init__(self, pinned: Iterable[str] = (), trust_file: str | Path | None = None) -> None:
        self.pinned = {key.strip() for key in pinned if key.strip()}
        for key in self.pinned:
            _verify_key(key)  # a typo in a pinned key is an error at start, not a silent refusal
        self.trust_file = Path(trust_file) if trust_file else None
        if self.trust_file is not None and self.trust_file.exists():
            self.pinned |= {
                line.strip() for line in self.trust_file.read_text().splitlines() if line.strip()
            }
        self._keys: dict[str, nacl.signing.VerifyKey] = {}
        self._last_seq: dict[int, int] = {}

    @property
    def required(self) -> bool:
        return bool(self.pinned) or self.trust_file is not None

    def trust(self, key: str) -> bool:
        """Whether ``key`` (a leader record's) is one to obey; on first use with a
        trust file and nothing pinned yet, it is recorded and pinned."""
        if key in self.pinned:
            return True
        if self.pinned or self.trust_file is None or not key:
            return False
        try:
            _verify_key(key)
        except ValueError:
            return False
        self.trust_file.parent.mkdir(parents=True, exist_ok=True)
        self.trust_file.write_text(key + "\n")
        self.pinned.add(key)
        log.warning(
            "trusting coordinator key %s on first use (recorded in %s)", key, self.trust_file
        )
        return True

    def check(
        self, key: str, epoch: int, subject: str, headers: Mapping[str, str] | None, body: bytes
    ) -> str | None:
        """Why the command must be refused, or None when it may be obeyed."""
        if not key:
            return f"the leader record of epoch {epoch} names no signing key"
        if not self.trust(key):
            return f"the leader of epoch {epoch} signs with {key}, which this agent does not trust"
        if not headers or SIG_HEADER not in headers or SEQ_HEADER not in headers:
            return "unsigned"
        try:
            seq = int(headers[SEQ_HEADER])
            signature = base64.b64decode(headers[SIG_HEADER], validate=True)
            self._check_signature(key, _signed_bytes(subject, seq, body), signature)
        except (ValueError, binascii.Error, nacl.exceptions.BadSignatureError):
            return f"the signature does not match key {key} for this subject and body"
        if seq <= self._last_seq.get(epoch, 0):
            return f"replayed: sequence {seq} of epoch {epoch} is not above {self._last_seq[epoch]}"
        self._last_seq[epoch] = seq
        for old in [e for e in self._last_seq if e < epoch - 1]:
            del self._last_seq[old]
        return None

    def open_record(self, name: str, data: bytes) -> bytes:
        """The record JSON inside ``data`` (the value of KV key ``name``).

        When signatures are required, it must be sealed by a trusted key for
        that KV key, else ValueError says why; otherwise a sealed record is
        opened unchecked and a plain one returned as it is."""
        try:
            sealed = _SEALED.decode(data)
        except (msgspec.DecodeError, RecursionError):
            if self.required:
                raise ValueError("not sealed by the fleet's signing key") from None
            return data
        if self.required:
            if not self.trust(sealed.key):
                raise ValueError(f"sealed by {sealed.key}, which is not trusted")
            try:
                signature = base64.b64decode(sealed.sig, validate=True)
                self._check_signature(
                    sealed.key, _sealed_bytes(name, bytes(sealed.record)), signature
                )
            except (ValueError, binascii.Error, nacl.exceptions.BadSignatureError):
                raise ValueError(f"the seal does not match key {sealed.key} for {name}") from None
        return bytes(sealed.record)

    def _check_signature(self, key: str, signed: bytes, signature: bytes) -> None:
        """Raises BadSignatureError unless ``signature`` is ``key``'s over ``signed``."""
        proof = (key, hashlib.sha256(signed).digest(), signature)
        if proof in _proven:
            _proven.move_to_end(proof)
            return
        self._verifier(key).verify(signed, signature)
        _proven[proof] = None
        if len(_proven) > _PROVEN_KEPT:
            _proven.popitem(last=False)

    def _verifier(self, key: str) -> nacl.signing.VerifyKey:
        verifier = self._keys.get(key)
        if verifier is None:
            verifier = self._keys[key] = _verify_key(key)
        return verifier


def _verify_key(public_key: str) -> nacl.signing.VerifyKey:
    try:
        raw = _decode_public(public_key)
    except (nkeys.NkeysError, binascii.Error, ValueError) as exc:
        raise ValueError(f"{public_key!r} is not an nkey public key: {exc}") from exc
    return nacl.signing.VerifyKey(raw)


def _decode_public(public_key: str) -> bytes:
    """The 32 raw bytes of an nkey public key (``A...``), its checksum checked."""
    data = base64.b32decode(public_key.encode() + b"=" * (-len(public_key) % 8))
    if len(data) != 35:
        raise ValueError("wrong length")
    prefix, raw, checksum = data[0], data[1:33], data[33:]
    if not nkeys.valid_public_prefix_byte(prefix):
        raise ValueError("wrong prefix")
    if int.from_bytes(checksum, "little") != nkeys.crc16(bytearray(data[:33])):
        raise ValueError("bad checksum")
    return raw
