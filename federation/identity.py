"""Who a certificate names, by one rule, and what a party's own certificate must satisfy.

A party is the name in its certificate: exactly one subject common name, exactly one DNS
subject alternative name, and the two equal. A certificate whose CN and SAN differ names no
party and is refused, at the endpoint (the caller) and at the receiver (the sender it asked),
so an organisation's PKI cannot make the two ends disagree about who a peer is. A party may
also pin each peer's certificate by its SHA-256 fingerprint (``[pins]`` in ``party.toml``):
then a certificate the CA signed for the same name is refused too.

gRPC's Python client does not show the server's certificate, so the endpoint proves the
sender of each message: it signs the message's key and digest with its certificate's key and
sends the certificate along; the receiver checks chain, name, pin and signature
(:func:`check_sender`). The endpoint learns the caller's certificate from the TLS session.

Nothing here imports gRPC; :mod:`federation.transport_grpc` applies it.
"""

from __future__ import annotations

import datetime
import functools
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.oid import NameOID

EXPIRY_WARNING_DAYS = 30
_PROOF_CONTEXT = b"privreg message sender proof v1\n"


class IdentityError(ValueError):
    """A certificate names no party, not the expected one, or is not trusted."""


@dataclass(frozen=True)
class Presented:
    """What one certificate claims: its names and fingerprint, before any rule is applied."""

    common_names: tuple[str, ...]
    dns_names: tuple[str, ...]
    fingerprint: str
    not_after: datetime.datetime

    def party(self) -> str:
        """The party this certificate names under the one rule, or :class:`IdentityError`."""
        if len(self.common_names) != 1 or len(self.dns_names) != 1:
            raise IdentityError(
                f"the certificate has {len(self.common_names)} common names "
                f"{list(self.common_names)} and {len(self.dns_names)} DNS names "
                f"{list(self.dns_names)}; a party's has exactly one of each, both its name"
            )
        if self.common_names[0] != self.dns_names[0]:
            raise IdentityError(
                f"the certificate's CN {self.common_names[0]!r} and DNS SAN "
                f"{self.dns_names[0]!r} differ; a party's certificate names it in both"
            )
        return self.common_names[0]

    def shown(self) -> str:
        """The names as presented, for a log line about a refused caller."""
        return f"CN {list(self.common_names)}, DNS SAN {list(self.dns_names)}"


def fingerprint(cert: x509.Certificate) -> str:
    """``sha256:<hex>`` of the DER certificate, the form ``[pins]`` takes."""
    return "sha256:" + cert.fingerprint(hashes.SHA256()).hex()


def load_chain(pem: bytes) -> list[x509.Certificate]:
    """Every certificate in a PEM bundle, the first being the holder's own."""
    try:
        chain = x509.load_pem_x509_certificates(pem)
    except ValueError as error:
        raise IdentityError(f"not a PEM certificate: {error}") from None
    return chain


def describe(cert: x509.Certificate) -> Presented:
    names = tuple(str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME))
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = tuple(san.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        dns = ()
    return Presented(names, dns, fingerprint(cert), cert.not_valid_after_utc)


@functools.lru_cache(maxsize=256)
def presented(pem: bytes) -> Presented:
    """The first certificate of ``pem`` described (cached: peers present the same bytes)."""
    return describe(load_chain(pem)[0])


def check_pin(party: str, seen: str, pins: dict[str, str]) -> None:
    """Refuse ``party``'s certificate if this party pinned another fingerprint for it."""
    pinned = pins.get(party)
    if pinned is not None and pinned.lower() != seen.lower():
        raise IdentityError(f"{party}'s certificate {seen} is not the one pinned for it ({pinned})")


def verify_chain(
    chain: list[x509.Certificate], roots: list[x509.Certificate], at: datetime.datetime
) -> None:
    """Refuse unless ``chain[0]`` leads through ``chain[1:]`` to one of ``roots``, every
    certificate on the way valid at ``at`` (the check TLS makes, for the sender's proof and
    an endpoint's own certificate)."""
    current, rest = chain[0], list(chain[1:])
    for _ in range(len(chain) + 1):
        _check_validity(current, at)
        for root in roots:
            if _issued_by(current, root):
                _check_validity(root, at)
                return
        parent = next((c for c in rest if _issued_by(current, c)), None)
        if parent is None:
            break
        rest.remove(parent)
        current = parent
    raise IdentityError(
        f"the certificate of {describe(chain[0]).shown()} (issuer "
        f"{chain[0].issuer.rfc4514_string()!r}) does not chain to this party's CA (tls.ca)"
    )


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    if cert.issuer != issuer.subject:
        return False
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _check_validity(cert: x509.Certificate, at: datetime.datetime) -> None:
    if at > cert.not_valid_after_utc:
        raise IdentityError(
            f"the certificate of {describe(cert).shown()} expired on "
            f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
        )
    if at < cert.not_valid_before_utc:
        raise IdentityError(
            f"the certificate of {describe(cert).shown()} is not valid before "
            f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
        )


@functools.lru_cache(maxsize=16)
def _roots(ca_pem: bytes) -> tuple[x509.Certificate, ...]:
    return tuple(load_chain(ca_pem))


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


# ---- the endpoint's own certificate -------------------------------------------------------


@dataclass(frozen=True)
class OwnCertificate:
    """A party's checked credentials: what it presents and signs with."""

    party: str
    fingerprint: str
    not_after: datetime.datetime
    chain_pem: bytes
    key: object  # a cryptography private key

    def days_left(self, at: datetime.datetime | None = None) -> float:
        return (self.not_after - (at or now())).total_seconds() / 86400

    def summary(self) -> str:
        days = self.days_left()
        warn = f" (WARNING: under {EXPIRY_WARNING_DAYS} days)" if days < EXPIRY_WARNING_DAYS else ""
        return (
            f"certificate CN = DNS SAN = {self.party}, {self.fingerprint}, expires "
            f"{self.not_after:%Y-%m-%d %H:%M} UTC, in {days:.0f} days{warn}"
        )


def check_own(party: str, ca: Path, cert: Path, key: Path) -> OwnCertificate:
    """The checks an endpoint makes on itself before it serves, one :class:`IdentityError`
    (one line) for the first that fails: the key is its owner's alone, the certificate
    chains to the CA, is valid now, names ``party`` by the one rule and matches the key."""
    for path in (ca, cert, key):
        if not path.is_file():
            raise IdentityError(f"party {party}: {path} does not exist or is not a file")
    mode = stat.S_IMODE(os.stat(key).st_mode)
    if mode & 0o077:
        raise IdentityError(
            f"party {party}: private key {key} is readable by group or others "
            f"(mode {mode:04o}); run chmod 600 {key}"
        )
    pem = cert.read_bytes()  # read once: what is checked is what is used
    try:
        chain = load_chain(pem)
        verify_chain(chain, list(_roots(ca.read_bytes())), now())
        named = describe(chain[0]).party()
        private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    except (IdentityError, ValueError, TypeError) as error:
        raise IdentityError(f"party {party}: {cert.name}: {error}") from None
    if named != party:
        raise IdentityError(f"party {party}: {cert.name} is issued to {named!r}, not to this party")
    if _public_der(private.public_key()) != _public_der(chain[0].public_key()):  # type: ignore[union-attr]
        raise IdentityError(f"party {party}: {key.name} is not the key of {cert.name}")
    return OwnCertificate(party, fingerprint(chain[0]), chain[0].not_valid_after_utc, pem, private)


def load_own(party: str, cert: Path, key: Path) -> OwnCertificate:
    """The credentials as they are, unchecked: what a client presents (the peer judges it)."""
    pem = cert.read_bytes()
    first = load_chain(pem)[0]
    private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    return OwnCertificate(party, fingerprint(first), first.not_valid_after_utc, pem, private)


def _public_der(public: object) -> bytes:
    return public.public_bytes(  # type: ignore[attr-defined]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


# ---- the sender's proof -------------------------------------------------------------------


def statement(fields: dict[str, object], size: int, sha256: str) -> bytes:
    """The bytes a sender signs: the message's key, size and digest (nothing else varies)."""
    parts = [f"{name}={fields[name]}" for name in ("run", "round", "sender", "receiver", "kind")]
    return _PROOF_CONTEXT + "\n".join([*parts, f"size={size}", f"sha256={sha256}"]).encode()


def sign(own: OwnCertificate, data: bytes) -> bytes:
    key = own.key
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, _PSS, hashes.SHA256())
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    raise IdentityError(f"party {own.party}: keys of type {type(key).__name__} cannot sign")


_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)


def check_sender(
    sender: str,
    chain_pem: bytes,
    signature: bytes,
    data: bytes,
    ca_pem: bytes,
    pins: dict[str, str],
) -> None:
    """Refuse a message unless ``sender``'s certificate (chained to the CA, named by the one
    rule, matching any pin) signed ``data``."""
    chain, seen = _trusted_chain(
        chain_pem, ca_pem, now().replace(minute=0, second=0, microsecond=0)
    )
    if (named := seen.party()) != sender:
        raise IdentityError(f"the serving certificate names {named!r}, not {sender!r}")
    check_pin(sender, seen.fingerprint, pins)
    public = chain[0].public_key()
    try:
        if isinstance(public, ec.EllipticCurvePublicKey):
            public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public, rsa.RSAPublicKey):
            public.verify(signature, data, _PSS, hashes.SHA256())
        elif isinstance(public, ed25519.Ed25519PublicKey):
            public.verify(signature, data)
        else:
            raise IdentityError(f"{sender}'s key type {type(public).__name__} is not supported")
    except InvalidSignature:
        raise IdentityError(f"the message is not signed by {sender}'s certificate") from None


@functools.lru_cache(maxsize=64)
def _trusted_chain(
    chain_pem: bytes, ca_pem: bytes, hour: datetime.datetime
) -> tuple[tuple[x509.Certificate, ...], Presented]:
    """The checked chain and what its certificate presents, cached for the hour (a peer
    presents the same bytes every fetch, and a relay carries a proof per sender)."""
    chain = load_chain(chain_pem)
    verify_chain(chain, list(_roots(ca_pem)), now())
    return tuple(chain), describe(chain[0])
