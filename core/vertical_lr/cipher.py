"""Integer Paillier operations the vertical protocol needs, over ``phe`` keys and gmpy2.

The protocol works on fixed-point integers it encodes itself (:mod:`.fixed_point`), so it
needs only exact integer operations on ciphertexts: encrypt, add, add a plaintext, multiply
by plaintext integers (``X^T [[d]]``), re-randomise and decrypt to signed integers. The
heavy ones delegate to :mod:`core.paillier` when it offers a faster path.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import gmpy2
import numpy as np
from phe import paillier

Ciphertexts = list[int]


def _nsquare(public: paillier.PaillierPublicKey) -> gmpy2.mpz:
    return gmpy2.mpz(public.nsquare)


def _obfuscator(public: paillier.PaillierPublicKey) -> gmpy2.mpz:
    """A fresh ``r^n mod n^2`` with ``r`` from the operating system's CSPRNG."""
    n = gmpy2.mpz(public.n)
    while True:
        r = gmpy2.mpz(secrets.randbelow(int(n) - 1) + 1)
        if gmpy2.gcd(r, n) == 1:
            return gmpy2.powmod(r, n, n * n)


def encrypt(public: paillier.PaillierPublicKey, values: Sequence[int]) -> Ciphertexts:
    """``(1 + m n) r^n mod n^2`` for each integer ``m`` (negatives as ``n - |m|``)."""
    n, nsq = gmpy2.mpz(public.n), _nsquare(public)
    return [int((1 + (gmpy2.mpz(v) % n) * n) * _obfuscator(public) % nsq) for v in values]


def rerandomize(public: paillier.PaillierPublicKey, cts: Sequence[int]) -> Ciphertexts:
    """Same plaintexts, fresh randomness: the receiver cannot link them to earlier values."""
    nsq = _nsquare(public)
    return [int(gmpy2.mpz(c) * _obfuscator(public) % nsq) for c in cts]


def add(public: paillier.PaillierPublicKey, a: Sequence[int], b: Sequence[int]) -> Ciphertexts:
    nsq = _nsquare(public)
    if len(a) != len(b):
        raise ValueError(f"cannot add ciphertext vectors of lengths {len(a)} and {len(b)}")
    return [int(gmpy2.mpz(x) * y % nsq) for x, y in zip(a, b, strict=True)]


def add_plain(
    public: paillier.PaillierPublicKey, cts: Sequence[int], values: Sequence[int]
) -> Ciphertexts:
    """``[[c + m]]`` without a fresh obfuscator (the caller re-randomises before sending)."""
    n, nsq = gmpy2.mpz(public.n), _nsquare(public)
    return [
        int(gmpy2.mpz(c) * (1 + (gmpy2.mpz(v) % n) * n) % nsq)
        for c, v in zip(cts, values, strict=True)
    ]


def weighted_sum(
    public: paillier.PaillierPublicKey, cts: Sequence[int], weights: Sequence[int]
) -> int:
    """``[[sum_i w_i m_i]]`` for plaintext integer weights (negative ones via the inverse)."""
    nsq = _nsquare(public)
    positive, negative = gmpy2.mpz(1), gmpy2.mpz(1)
    for c, w in zip(cts, weights, strict=True):
        if w > 0:
            positive = positive * gmpy2.powmod(gmpy2.mpz(c), w, nsq) % nsq
        elif w < 0:
            negative = negative * gmpy2.powmod(gmpy2.mpz(c), -w, nsq) % nsq
    return int(positive * gmpy2.invert(negative, nsq) % nsq)


def transpose_dot(
    public: paillier.PaillierPublicKey, X_int: np.ndarray, cts: Sequence[int]
) -> Ciphertexts:
    """``X^T [[d]]``: one encrypted sum per column of the integer matrix ``X``."""
    X_int = np.asarray(X_int)
    if X_int.shape[0] != len(cts):
        raise ValueError(f"X has {X_int.shape[0]} rows but [[d]] has {len(cts)} entries")
    return [weighted_sum(public, cts, [int(v) for v in X_int[:, j]]) for j in range(X_int.shape[1])]


def decrypt(private: paillier.PaillierPrivateKey, cts: Sequence[int]) -> list[int]:
    """Signed integers: plaintexts above n/2 are negatives."""
    n = private.public_key.n
    out = []
    for c in cts:
        m = private.raw_decrypt(int(c))
        out.append(m - n if m > n // 2 else m)
    return out


def random_masks(count: int, bits: int = 256) -> list[int]:
    """Masks that statistically hide any value below 2^(bits - 80)."""
    return [secrets.randbits(bits) for _ in range(count)]
