"""A fleet's certificate authority, for ``lorabus auth init``: the CA, and the
server, route and client certificates it issues (``cryptography``), each an
EC P-256 key and a certificate valid for :data:`CERTIFICATE_DAYS`. Keys are
written readable by their owner alone (0600), certificates by anyone but
writable by none (0644), whatever the umask.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["CERTIFICATE_DAYS", "CertificateAuthority", "write_public", "write_secret"]

CERTIFICATE_DAYS = 365


class CertificateAuthority:
    """A CA of one fleet, for its server, route and client certificates."""

    def __init__(
        self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate, cert_file: Path
    ) -> None:
        self._key = key
        self._cert = cert
        self.cert_file = cert_file

    @classmethod
    def create(cls, directory: Path) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lorabus fleet CA")])
        cert = (
            _builder(name, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        cert_file = directory / "ca.pem"
        write_public(cert_file, cert.public_bytes(serialization.Encoding.PEM))
        write_secret(directory / "ca-key.pem", _pem_key(key))
        return cls(key, cert, cert_file)

    def issue_server(self, directory: Path, hosts: Sequence[str]) -> tuple[Path, Path, Path]:
        folder = directory / "server"
        folder.mkdir(mode=0o700)
        cert, key = self._issue(
            folder, "server", hosts[0], [ExtendedKeyUsageOID.SERVER_AUTH], _general_names(hosts)
        )
        return cert, key, self.cert_file

    def issue_client(self, folder: Path, name: str) -> tuple[Path, Path]:
        return self._issue(folder, "client", name, [ExtendedKeyUsageOID.CLIENT_AUTH], [])

    def issue_route(self, directory: Path, hosts: Sequence[str]) -> tuple[Path, Path]:
        """One certificate for every node's routes: a route both dials and
        answers, so it is a client and a server certificate at once."""
        return self._issue(
            directory / "server",
            "route",
            "lorabus route",
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
            _general_names(hosts),
        )

    def _issue(
        self,
        folder: Path,
        stem: str,
        common_name: str,
        usage: list[x509.ObjectIdentifier],
        names: list[x509.GeneralName],
    ) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        builder = _builder(subject, self._cert.subject, key.public_key()).add_extension(
            x509.ExtendedKeyUsage(usage), critical=False
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        cert_file, key_file = folder / f"{stem}-cert.pem", folder / f"{stem}-key.pem"
        write_public(cert_file, cert.public_bytes(serialization.Encoding.PEM))
        write_secret(key_file, _pem_key(key))
        return cert_file, key_file


def _general_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERTIFICATE_DAYS))
    )


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_secret(path: Path, data: bytes) -> None:
    """A key or another secret, readable by its owner alone (0600)."""
    _write_new(path, data, 0o600)


def write_public(path: Path, data: bytes) -> None:
    """A certificate: 0644 at most, whatever the umask (a plain write asks for
    0666, which umask 000 leaves writable by anyone)."""
    _write_new(path, data, 0o644)


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Write a file that must not exist yet (keys are never overwritten)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)
