"""Fixed-point encoding of float vectors into the ring Z_2^64.

Why: masks only cancel exactly in a finite ring, and uint64 numpy arithmetic *is* arithmetic
mod 2^64 (it wraps), so a masked sum costs one vectorised add per party.

Encoding: ``x -> round(x * 2**scale_bits)`` as a signed 64-bit integer, stored in two's
complement as uint64. Decoding reads the ring sum back as int64 and divides by the scale.
With the default ``scale_bits = 24`` the resolution is 2^-24 (about 6e-8) and each encoded
value carries at most 2^-25 rounding error.

The sum of ``n_parties`` encoded values decodes correctly only if the true integer sum lies in
[-2^63, 2^63). Encoding therefore refuses any value with ``|x| * 2**scale_bits`` larger than
``(2**63 - 1) // n_parties``: then no sum of ``n_parties`` such values can wrap.
"""

from __future__ import annotations

import math

import numpy as np

from core.secagg.errors import FixedPointError

DEFAULT_SCALE_BITS = 24
RING_BITS = 64
MAX_SCALE_BITS = 52  # beyond this a float64 cannot hold the scaled value exactly anyway


def max_abs_value(n_parties: int, scale_bits: int = DEFAULT_SCALE_BITS) -> float:
    """Largest ``|x|`` one party may encode so that the sum of ``n_parties`` cannot wrap."""
    _check_parameters(n_parties, scale_bits)
    return _max_abs_scaled(n_parties) / 2.0**scale_bits


def encode(
    values: np.ndarray,
    n_parties: int,
    scale_bits: int = DEFAULT_SCALE_BITS,
    *,
    party: str = "this party",
) -> np.ndarray:
    """Encode a float vector into Z_2^64, refusing values whose n-party sum could wrap.

    ``party`` only labels error messages, so an operator can tell whose data overflowed.
    """
    _check_parameters(n_parties, scale_bits)
    floats = np.asarray(values, dtype=np.float64)
    if floats.ndim != 1:
        raise FixedPointError(f"{party}: expected a 1-D vector, got shape {floats.shape}")
    not_finite = ~np.isfinite(floats)
    if not_finite.any():
        index = int(np.argmax(not_finite))
        raise FixedPointError(
            f"{party}: element {index} is {floats[index]!r}; only finite values can be encoded"
        )
    scaled = np.rint(np.ldexp(floats, scale_bits))
    limit = _max_abs_scaled(n_parties)
    too_large = np.abs(scaled) > limit
    if too_large.any():
        index = int(np.argmax(too_large))
        raise FixedPointError(
            f"{party}: element {index} = {floats[index]!r} exceeds the fixed-point range "
            f"+-{limit / 2.0**scale_bits:.6g} for {n_parties} parties at scale 2^{scale_bits}; "
            "the sum could wrap around 2^64. Normalise the data or lower scale_bits."
        )
    return scaled.astype(np.int64).view(np.uint64)


def add_in_ring(ring_values: np.ndarray, integers: np.ndarray) -> np.ndarray:
    """``ring_values + integers`` in Z_2^64: how a party adds its integer noise share to its
    encoded input before masking (the sum then carries the noise, no party's input alone)."""
    ring = np.asarray(ring_values)
    if ring.dtype != np.uint64 or np.shape(integers) != ring.shape:
        raise FixedPointError(f"expected a uint64 ring vector and integers of shape {ring.shape}")
    return ring + np.asarray(integers, dtype=np.int64).view(np.uint64)


def decode(ring_values: np.ndarray, scale_bits: int = DEFAULT_SCALE_BITS) -> np.ndarray:
    """Decode ring elements (e.g. an unmasked sum) back to floats."""
    ring = np.asarray(ring_values)
    if ring.dtype != np.uint64:
        raise FixedPointError(f"expected a uint64 ring vector, got dtype {ring.dtype}")
    return np.ldexp(ring.view(np.int64).astype(np.float64), -scale_bits)


def _max_abs_scaled(n_parties: int) -> float:
    """Per-party bound on the scaled magnitude, rounded down to a float64."""
    bound = (2 ** (RING_BITS - 1) - 1) // n_parties
    as_float = float(bound)
    return as_float if as_float <= bound else math.nextafter(as_float, 0.0)


def _check_parameters(n_parties: int, scale_bits: int) -> None:
    if n_parties < 1:
        raise FixedPointError(f"n_parties must be at least 1, got {n_parties}")
    if not 0 <= scale_bits <= MAX_SCALE_BITS:
        raise FixedPointError(f"scale_bits must be in [0, {MAX_SCALE_BITS}], got {scale_bits}")
