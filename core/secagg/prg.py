"""Expansion of a 32-byte seed into a uint64 mask vector with a cryptographic PRG.

Why ChaCha20: its keystream is indistinguishable from random for anyone without the seed,
it is constant-time in software, and OpenSSL produces it at several GB/s, so masking a
million-entry update costs milliseconds. Every seed handed to this module is used for exactly
one mask (seeds are derived per session, per pair and per purpose), so a fixed all-zero
nonce/counter block is safe.
"""

from __future__ import annotations

import threading

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

SEED_BYTES = 32
_NONCE = bytes(16)  # 32-bit block counter + 96-bit nonce, both zero: each key is single-use
_WORD = np.dtype("<u8")  # explicit little-endian so masks agree across machines
_SLACK = 64  # update_into wants room for a partial block beyond the input
_SCRATCH = threading.local()
_ZEROS = {"bytes": b""}


def _keystream(seed: bytes, length: int, out: np.ndarray) -> np.ndarray:
    """The first ``length`` keystream words of ``seed``, written into ``out`` (uint8)."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"mask seed must be {SEED_BYTES} bytes, got {len(seed)}")
    size = length * _WORD.itemsize
    zeros = _ZEROS["bytes"]
    if len(zeros) < size:
        zeros = _ZEROS["bytes"] = bytes(size)  # immutable, so threads may share it
    cipher = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor()
    cipher.update_into(memoryview(zeros)[:size], out)
    return out[:size].view(_WORD).astype(np.uint64, copy=False)


def expand_mask(seed: bytes, length: int) -> np.ndarray:
    """Return ``length`` pseudo-random uint64 values determined by ``seed``."""
    if length < 0:
        raise ValueError(f"mask length must be non-negative, got {length}")
    return _keystream(seed, length, np.empty(length * _WORD.itemsize + _SLACK, dtype=np.uint8))


def apply_mask(target: np.ndarray, seed: bytes, sign: int) -> None:
    """``target += sign * expand_mask(seed, len(target))`` in Z_2^64, in place.

    Why a separate function: the masking loops call it once per neighbour, and writing the
    keystream into a reused per-thread buffer is about three times faster than a fresh array.
    """
    size = target.size * _WORD.itemsize + _SLACK
    scratch = getattr(_SCRATCH, "buffer", None)
    if scratch is None or scratch.size < size:
        scratch = _SCRATCH.buffer = np.empty(size, dtype=np.uint8)
    mask = _keystream(seed, target.size, scratch)
    if sign > 0:
        np.add(target, mask, out=target)
    else:
        np.subtract(target, mask, out=target)
