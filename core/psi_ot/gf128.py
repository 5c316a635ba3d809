"""GF(2^128) arithmetic for the VOLE-based PSI, vectorised with numpy.

An element is 16 bytes, bit ``j`` (byte ``j // 8``, bit ``j % 8``) the coefficient of ``x^j``,
modulo ``x^128 + x^7 + x^2 + x + 1`` (the GCM polynomial, here in plain bit order). Arrays of
elements are ``(n, 2)`` uint64 (low word first), the same bytes as ``(n, 16)`` uint8, so a row
of an OT-extension matrix *is* a field element. Addition is XOR. The only products the PSI
needs are by one fixed secret (``Delta``) over many elements, done with 16 byte-indexed tables
(:func:`mul_const`; in the optional C kernel when built, :mod:`.native`), and by ``x``
(:func:`mul_x`).
"""

from __future__ import annotations

import numpy as np

from core.psi_ot import native

_REDUCTION = 0x87  # x^7 + x^2 + x + 1
_MASK = (1 << 128) - 1


def to_words(data: np.ndarray) -> np.ndarray:
    """``(n, 16)`` uint8 as ``(n, 2)`` uint64 (a copy when not contiguous)."""
    return np.ascontiguousarray(data, dtype=np.uint8).view("<u8").reshape(-1, 2)


def to_int(element: bytes) -> int:
    """One 16-byte element as a Python integer (bit j = coefficient of x^j)."""
    return int.from_bytes(element, "little")


def from_int(value: int) -> bytes:
    return value.to_bytes(16, "little")


def mul_int(a: int, b: int) -> int:
    """The product of two elements as integers (schoolbook; for tables and tests)."""
    out = 0
    while b:
        if b & 1:
            out ^= a
        b >>= 1
        a = ((a << 1) & _MASK) ^ (_REDUCTION if a >> 127 else 0)
    return out


def mul_x(values: np.ndarray) -> np.ndarray:
    """Each element times ``x``."""
    lo, hi = values[:, 0], values[:, 1]
    out = np.empty_like(values)
    out[:, 1] = (hi << np.uint64(1)) | (lo >> np.uint64(63))
    out[:, 0] = (lo << np.uint64(1)) ^ ((hi >> np.uint64(63)) * np.uint64(_REDUCTION))
    return out


def _tables(constant: bytes) -> np.ndarray:
    """``T[j, b] = (b x^(8j)) * constant`` for each byte position ``j`` and byte value ``b``."""
    basis, value = [], to_int(constant)
    for _ in range(128):  # constant * x^i
        basis.append(value)
        value = ((value << 1) & _MASK) ^ (_REDUCTION if value >> 127 else 0)
    words = np.array([[v & (2**64 - 1), v >> 64] for v in basis], dtype=np.uint64).reshape(16, 8, 2)
    tables = np.zeros((16, 256, 2), dtype=np.uint64)
    for bit in range(8):
        has = (np.arange(256) >> bit) & 1 == 1
        tables[:, has] ^= words[:, bit][:, None, :]
    return tables


def mul_const(constant: bytes, values: np.ndarray) -> np.ndarray:
    """``constant * v`` for every element ``v`` of ``values`` (``(n, 2)`` uint64)."""
    tables = _tables(constant)
    data = np.ascontiguousarray(values).view(np.uint8).reshape(-1, 16)
    out = np.zeros((len(data), 2), dtype=np.uint64)
    kernel = native.kernel()
    if kernel is not None:
        kernel.mul_tables(tables, data, out)
        return out
    for j in range(16):
        out ^= tables[j][data[:, j]]
    return out


def pack_bits(rows: np.ndarray) -> np.ndarray:
    """``sum_k x^k rows[i, k]`` for each group ``i``: ``(t, 128, 2)`` to ``(t, 2)`` (Horner).

    Turns 128 correlations ``t_k = q_k + r_k Delta`` (``r_k`` a bit) into one with a field
    element: ``sum x^k t_k = sum x^k q_k + (sum r_k x^k) Delta``."""
    out = np.zeros((rows.shape[0], 2), dtype=np.uint64)
    for k in range(rows.shape[1] - 1, -1, -1):
        out = mul_x(out) ^ rows[:, k]
    return out
