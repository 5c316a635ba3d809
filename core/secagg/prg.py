"""Expansion of a 32-byte seed into a uint64 mask vector with a cryptographic PRG.

Why ChaCha20: its keystream is indistinguishable from random for anyone without the seed,
it is constant-time in software, and OpenSSL produces it at several GB/s, so masking a
million-entry update costs milliseconds. Every seed handed to this module is used for exactly
one mask (seeds are derived per session, per pair and per purpose), so a fixed all-zero
nonce/counter block is safe.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

SEED_BYTES = 32
_NONCE = bytes(16)  # 32-bit block counter + 96-bit nonce, both zero: each key is single-use
_WORD = np.dtype("<u8")  # explicit little-endian so masks agree across machines


def expand_mask(seed: bytes, length: int) -> np.ndarray:
    """Return ``length`` pseudo-random uint64 values determined by ``seed``."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"mask seed must be {SEED_BYTES} bytes, got {len(seed)}")
    if length < 0:
        raise ValueError(f"mask length must be non-negative, got {length}")
    keystream = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor()
    words = np.frombuffer(keystream.update(bytes(length * _WORD.itemsize)), dtype=_WORD)
    return words.astype(np.uint64, copy=False)
