"""A demo certificate authority and per-party certificates for the mutual-TLS channel.

Each party's certificate names the party in its subject common name and as a DNS subject
alternative name: the channel takes a sender's identity from there, never from a message.
An organisation that has its own PKI issues the same kind of certificate instead (see the
docs/operator.md); nothing else in privreg depends on this module.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from federation.channel import check_name


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """The private key, readable by its owner only (0600 from creation, not chmod-ed later)."""
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def create_ca(folder: str | Path, name: str = "privreg demo CA", days: int = 365) -> Issued:
    """A self-signed CA (ECDSA P-256) in ``folder/ca.pem`` and ``folder/ca.key``."""
    folder = Path(folder)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
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
    issued = Issued(folder / "ca.pem", folder / "ca.key")
    _write_key(issued.key, key)
    _write_cert(issued.cert, cert)
    return issued


def issue(
    ca: Issued,
    party: str,
    folder: str | Path,
    days: float = 365,
    valid_from: datetime.datetime | None = None,
    common_name: str | None = None,
    dns_names: list[str] | None = None,
) -> Issued:
    """A certificate for ``party`` (client and server use) signed by ``ca``, valid from
    ``valid_from`` (default: five minutes ago) for ``days``. ``common_name`` and
    ``dns_names`` replace the party's name in the subject and the SAN, for testing that
    certificates breaking the one identity rule are refused."""
    check_name(party, "party")
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    start = valid_from or datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    names = [x509.DNSName(name) for name in (dns_names if dns_names is not None else [party])]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name or party))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    folder = Path(folder)
    issued = Issued(folder / f"{party}.pem", folder / f"{party}.key")
    _write_key(issued.key, key)
    _write_cert(issued.cert, cert)
    return issued
