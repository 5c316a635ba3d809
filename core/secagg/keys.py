"""Key agreement, key derivation and share encryption for secure aggregation.

Why two X25519 key pairs per party (as in Bonawitz et al. 2017): the *mask* key pair seeds
the pairwise masks and is Shamir-shared so a dropped party's masks can be removed; the
*encryption* key pair only protects the shares in transit and is never shared, so
reconstructing a dropped party's mask key does not also open the shares it received.

Every derived secret is bound by HKDF to the session, the purpose and the ordered pair of
parties, so no seed or AEAD key is ever used in two places.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from core.secagg.errors import ProtocolViolationError

KEY_BYTES = 32
_NONCE_BYTES = 12
_PROTOCOL_LABEL = "privreg/secagg/v1"


def new_key_pair() -> tuple[bytes, bytes]:
    """Fresh X25519 key pair as raw ``(private, public)`` bytes (OS randomness)."""
    private = X25519PrivateKey.generate()
    return _private_bytes(private), _public_bytes(private.public_key())


def public_key_of(private_key: bytes) -> bytes:
    """Raw public key belonging to a raw private key (used to verify reconstructed keys)."""
    return _public_bytes(X25519PrivateKey.from_private_bytes(private_key).public_key())


def pairwise_mask_seed(
    own_private: bytes, peer_public: bytes, session_id: str, own: str, peer: str
) -> bytes:
    """Seed of the mask that parties ``own`` and ``peer`` share in this session."""
    return _derive(_agree(own_private, peer_public, peer), "pairwise-mask", session_id, own, peer)


def share_encryption_key(
    own_private: bytes, peer_public: bytes, session_id: str, own: str, peer: str
) -> bytes:
    """AES-256-GCM key protecting the shares that ``own`` and ``peer`` send each other."""
    shared = _agree(own_private, peer_public, peer)
    return _derive(shared, "share-encryption", session_id, own, peer)


def encrypt_share_bundle(
    key: bytes, session_id: str, sender: str, recipient: str, plaintext: bytes
) -> bytes:
    """Encrypt shares for ``recipient``; the header is authenticated so they cannot be re-routed."""
    nonce = os.urandom(_NONCE_BYTES)
    header = _context("share-bundle", session_id, sender, recipient)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, header)


def decrypt_share_bundle(
    key: bytes, session_id: str, sender: str, recipient: str, ciphertext: bytes
) -> bytes:
    """Decrypt and authenticate shares that ``sender`` addressed to ``recipient``."""
    header = _context("share-bundle", session_id, sender, recipient)
    nonce, body = ciphertext[:_NONCE_BYTES], ciphertext[_NONCE_BYTES:]
    try:
        return AESGCM(key).decrypt(nonce, body, header)
    except (InvalidTag, ValueError) as error:
        raise ProtocolViolationError(
            f"encrypted shares from party {sender!r} to {recipient!r} failed authentication "
            "(tampered, re-routed or from another session)"
        ) from error


def commit_self_mask_seed(session_id: str, party: str, seed: bytes) -> bytes:
    """Hash commitment to a self-mask seed, so the coordinator can detect a bad share.

    The seed has 256 bits of entropy, so the hash reveals nothing useful about it.
    """
    return hashlib.sha256(_context("self-mask-commitment", session_id, party) + seed).digest()


def agree_with_peers(own_private: bytes, peers: Mapping[str, bytes]) -> dict[str, bytes]:
    """Raw X25519 shared secrets with each peer (derive keys from them with HKDF only).

    The private key is loaded once for all peers: loading costs as much as an exchange.
    """
    private = X25519PrivateKey.from_private_bytes(own_private)
    shared = {}
    for peer, public in peers.items():
        try:
            shared[peer] = private.exchange(X25519PublicKey.from_public_bytes(public))
        except ValueError as error:
            raise ProtocolViolationError(
                f"key agreement with {peer!r} failed: invalid or low-order X25519 public key"
            ) from error
    return shared


def _agree(own_private: bytes, peer_public: bytes, peer: str) -> bytes:
    try:
        private = X25519PrivateKey.from_private_bytes(own_private)
        return private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as error:
        raise ProtocolViolationError(
            f"key agreement with {peer!r} failed: invalid or low-order X25519 public key"
        ) from error


def _derive(shared_secret: bytes, purpose: str, session_id: str, a: str, b: str) -> bytes:
    """HKDF-SHA256 bound to purpose, session and the (sorted, hence symmetric) pair."""
    first, second = sorted((a, b))
    info = _context(purpose, session_id, first, second)
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(
        shared_secret
    )


def _context(*fields: str) -> bytes:
    """Unambiguous (length-prefixed) encoding of the protocol label and ``fields``."""
    parts = [_PROTOCOL_LABEL, *fields]
    return b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)


def _private_bytes(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )


def _public_bytes(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
