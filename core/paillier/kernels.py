"""Chunk functions executed by the backends (serially, in worker processes or on Dask).

Each takes only plain data -- moduli as ints, ciphertexts as gmpy2/Python ints, exponents as
int64 arrays or int lists -- and returns ints, so results are identical on every backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import gmpy2
import numpy as np
from gmpy2 import mpz

from core.paillier.decryption import CrtDecryptor
from core.paillier.errors import PaillierError
from core.paillier.multiexp import multiexp_columns


def xt_dot_chunk(
    n_square: int, ciphertexts: Sequence[int | mpz], exponents: np.ndarray
) -> list[mpz]:
    """Partial X^T [[d]] over a block of rows: one ciphertext per column."""
    return multiexp_columns([mpz(c) for c in ciphertexts], exponents, mpz(n_square))


def power_chunk(
    n_square: int, ciphertexts: Sequence[int | mpz], exponents: Sequence[int]
) -> list[mpz]:
    """Elementwise c_i^(e_i) mod n^2 for signed integer exponents (plaintext times e_i)."""
    modulus = mpz(n_square)
    results = []
    for position, (ciphertext, exponent) in enumerate(zip(ciphertexts, exponents, strict=True)):
        base = mpz(ciphertext)
        if exponent < 0:
            base = _inverse(base, modulus, position)
            exponent = -exponent
        results.append(gmpy2.powmod(base, exponent, modulus))
    return results


def scalar_power_chunk(n_square: int, ciphertexts: Sequence[int | mpz], exponent: int) -> list[mpz]:
    """c_i^e mod n^2 with one shared exponent (batched in C by gmpy2)."""
    modulus = mpz(n_square)
    bases = [mpz(c) for c in ciphertexts]
    if exponent < 0:
        bases = [_inverse(base, modulus, position) for position, base in enumerate(bases)]
        exponent = -exponent
    return gmpy2.powmod_base_list(bases, exponent, modulus)


def decrypt_chunk(p: int, q: int, ciphertexts: Sequence[int | mpz]) -> list[mpz]:
    """Raw CRT decryption of a block of ciphertexts (carries the private key: sensitive)."""
    return CrtDecryptor(p, q).decrypt_many(ciphertexts)


def pack_chunk(
    n: int, slot_bits: int, offset_plaintext: int, groups: Sequence[Sequence[int | mpz]]
) -> list[mpz]:
    """Horner-pack each group: slot j of the result holds group[j] + offset at bit j*slot_bits."""
    n_mpz = mpz(n)
    modulus = n_mpz * n_mpz
    shift = mpz(1) << slot_bits
    packed = []
    for group in groups:
        accumulator = mpz(group[-1])
        for ciphertext in reversed(group[:-1]):
            accumulator = gmpy2.powmod(accumulator, shift, modulus) * ciphertext % modulus
        offset = _group_offset(offset_plaintext, slot_bits, len(group))
        packed.append(accumulator * (1 + n_mpz * offset) % modulus)
    return packed


def _group_offset(offset_plaintext: int, slot_bits: int, slots: int) -> int:
    return sum(offset_plaintext << (slot_bits * j) for j in range(slots))


def _inverse(ciphertext: mpz, modulus: mpz, position: int) -> mpz:
    try:
        return gmpy2.invert(ciphertext, modulus)
    except ZeroDivisionError as exc:
        raise PaillierError(f"ciphertext at position {position} is not invertible mod n^2") from exc
