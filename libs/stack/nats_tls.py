"""TLS for NATS: a self-signed CA generated at first start, a server certificate it signs (for the
clients' port and the cluster routes), and, for mutual TLS, a client certificate per identity.

Keys are ECDSA P-256; certificates last :data:`VALIDITY_DAYS`. Files that exist are kept (a
restart keeps the CA every client trusts); deleting ``ca/`` and restarting re-issues everything
(docs/security.md, "Rotating"). Written with :func:`libs.stack.nats_secrets.write_private`.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from libs.stack.nats_secrets import write_private

VALIDITY_DAYS = 825
CA_NAME = "omnirelay NATS CA"


@dataclass(frozen=True)
class CertFiles:
    """A certificate and its key (PEM files)."""

    cert: Path
    key: Path


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def _load(files: CertFiles) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return cert, key


def _builder(
    subject: str, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALIDITY_DAYS))
    )


def ensure_ca(directory: Path) -> CertFiles:
    """``<directory>/ca.pem`` and ``ca-key.pem``: the CA, generated when missing."""
    files = CertFiles(directory / "ca.pem", directory / "ca-key.pem")
    if files.cert.exists() and files.key.exists():
        return files
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    cert = (
        _builder(CA_NAME, name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    write_private(files.key, _key_pem(key))
    write_private(files.cert, cert.public_bytes(serialization.Encoding.PEM).decode())
    return files


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def issue(ca: CertFiles, out: CertFiles, name: str, hosts: list[str], client: bool) -> CertFiles:
    """A certificate for ``name`` signed by ``ca`` into ``out``: a server's (valid for ``hosts``,
    host names or IP addresses; also usable by the cluster routes, which are clients of each other)
    or, with ``client``, an identity's for mutual TLS. Kept when it exists."""
    if out.cert.exists() and out.key.exists():
        return out
    ca_cert, ca_key = _load(ca)
    key = ec.generate_private_key(ec.SECP256R1())
    usages = (
        [ExtendedKeyUsageOID.CLIENT_AUTH]
        if client
        else [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    builder = (
        _builder(name, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    write_private(out.key, _key_pem(key))
    write_private(out.cert, cert.public_bytes(serialization.Encoding.PEM).decode())
    return out
