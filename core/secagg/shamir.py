"""t-of-n Shamir secret sharing of 32-byte secrets over the prime field GF(2^521 - 1).

Why this field: 2^521 - 1 is a Mersenne prime larger than any 256-bit secret, so a key or a
seed is one field element and no chunking is needed. Polynomial coefficients come from
``secrets``, so any ``threshold - 1`` shares are independent of the secret.

Share ``x`` coordinates are the parties' 1-based positions in the session's party list.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

PRIME = 2**521 - 1
SHARE_BYTES = 66  # ceil(521 / 8): fixed-width encoding of one share value
SECRET_BYTES = 32


def split_secret(secret: bytes, xs: Sequence[int], threshold: int) -> dict[int, int]:
    """Share ``secret`` so that any ``threshold`` of the points ``xs`` recover it."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secret must be {SECRET_BYTES} bytes, got {len(secret)}")
    if len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise ValueError(f"share points must be distinct non-zero field elements, got {xs}")
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold must be in [1, {len(xs)}], got {threshold}")
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    return {x: _evaluate(coefficients, x) for x in xs}


def reconstruct_secret(shares: Mapping[int, int], threshold: int) -> bytes:
    """Recover the secret from at least ``threshold`` shares (uses the first ``threshold``).

    A wrong share yields a wrong secret, not an error: callers verify the result against a
    public key or commitment.
    """
    if len(shares) < threshold:
        raise ValueError(f"need {threshold} shares to reconstruct, got {len(shares)}")
    points = sorted(shares.items())[:threshold]
    value = _interpolate_at_zero(points)
    if value >= 2 ** (8 * SECRET_BYTES):
        raise ValueError("shares do not reconstruct a 32-byte secret (inconsistent shares)")
    return value.to_bytes(SECRET_BYTES, "big")


def share_to_bytes(value: int) -> bytes:
    """Fixed-width big-endian encoding of a share value (for encryption)."""
    if not 0 <= value < PRIME:
        raise ValueError("share value is outside the field")
    return value.to_bytes(SHARE_BYTES, "big")


def share_from_bytes(data: bytes) -> int:
    """Inverse of :func:`share_to_bytes`."""
    if len(data) != SHARE_BYTES:
        raise ValueError(f"share must be {SHARE_BYTES} bytes, got {len(data)}")
    value = int.from_bytes(data, "big")
    if value >= PRIME:
        raise ValueError("share value is outside the field")
    return value


def _evaluate(coefficients: Sequence[int], x: int) -> int:
    """Horner evaluation of the polynomial at ``x`` modulo the prime."""
    result = 0
    for coefficient in reversed(coefficients):
        result = (result * x + coefficient) % PRIME
    return result


def _interpolate_at_zero(points: Sequence[tuple[int, int]]) -> int:
    """Lagrange interpolation of the polynomial through ``points``, evaluated at 0.

    The denominators are inverted together (one modular inverse, Montgomery's trick), since
    an inverse costs as much as dozens of products at this field size.
    """
    numerators, denominators = [], []
    for i, (x_i, _) in enumerate(points):
        numerator, denominator = 1, 1
        for j, (x_j, _) in enumerate(points):
            if i != j:
                numerator = numerator * x_j % PRIME
                denominator = denominator * (x_j - x_i) % PRIME
        numerators.append(numerator)
        denominators.append(denominator)
    inverses = _batch_inverse(denominators)
    total = 0
    for (_, y_i), numerator, inverse in zip(points, numerators, inverses, strict=True):
        total = (total + y_i * numerator % PRIME * inverse) % PRIME
    return total


def _batch_inverse(values: Sequence[int]) -> list[int]:
    """Inverses of non-zero field elements with a single modular inverse."""
    prefix = [1]
    for value in values:
        prefix.append(prefix[-1] * value % PRIME)
    inverse = pow(prefix[-1], -1, PRIME)
    result = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        result[i] = inverse * prefix[i] % PRIME
        inverse = inverse * values[i] % PRIME
    return result
