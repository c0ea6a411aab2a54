"""Throwaway certificate authorities for the test clusters, made with the cryptography library.

ECDSA P-256 keys: generated instantly, and accepted by every Kubernetes component for TLS, client
certificates and ES256 service-account tokens.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=30)


def write_secret(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _subject_alternative_names(sans: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for san in sans:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(san)))
        except ValueError:
            names.append(x509.DNSName(san))
    return names


@dataclass(frozen=True)
class IssuedPair:
    """A certificate and its key written as PEM files."""

    cert: Path
    key: Path


class CertificateAuthority:
    """A self-signed CA that issues server and client certificates into one directory."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert = write_secret(
            directory / f"{name}.crt", self._cert.public_bytes(serialization.Encoding.PEM)
        )
        self.key = write_secret(directory / f"{name}.key", key_pem(self._key))

    def issue(
        self,
        file_stem: str,
        common_name: str,
        *,
        sans: Sequence[str] = (),
        organizations: Sequence[str] = (),
        server: bool = False,
        client: bool = False,
    ) -> IssuedPair:
        """Sign a leaf certificate; ``organizations`` become Kubernetes groups for client certificates."""
        key = ec.generate_private_key(ec.SECP256R1())
        attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
        attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        usages = [
            *([ExtendedKeyUsageOID.SERVER_AUTH] if server else []),
            *([ExtendedKeyUsageOID.CLIENT_AUTH] if client else []),
        ]
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attributes))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if sans:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(_subject_alternative_names(sans)), critical=False
            )
        cert = builder.sign(self._key, hashes.SHA256())
        return IssuedPair(
            cert=write_secret(
                self.directory / f"{file_stem}.crt", cert.public_bytes(serialization.Encoding.PEM)
            ),
            key=write_secret(self.directory / f"{file_stem}.key", key_pem(key)),
        )


def signing_key_pair(directory: Path, stem: str) -> IssuedPair:
    """A bare key pair (the service-account token signer): ``cert`` holds the public key."""
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return IssuedPair(
        cert=write_secret(directory / f"{stem}.pub", public),
        key=write_secret(directory / f"{stem}.key", key_pem(key)),
    )
