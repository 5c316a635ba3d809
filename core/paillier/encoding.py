"""The single fixed-point encoding shared by every encrypted flow.

A real value v is represented by the signed integer round(v * 2**frac_bits); inside a
Paillier plaintext a negative integer -a is stored as n - a. Only magnitudes up to
``max_safe_magnitude(n)`` (= n // 3 - 1, the same bound ``phe`` uses) are decoded; anything in
the band between the positive and the negative range means a computation overflowed and is
reported as :class:`PaillierOverflowError` rather than decoded into garbage.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from core.paillier.errors import EncodingError, PaillierOverflowError, ShapeError

VALUE_FRAC_BITS = 32
"""Default precision of encrypted quantities (residuals, gradients, labels)."""

MULTIPLIER_FRAC_BITS = 16
"""Default precision of plain multipliers (features, scalars); kept short because the cost
of a ciphertext-times-plaintext exponentiation grows with the multiplier's bit length."""

MAX_FRAC_BITS = 1024
_INT64_SAFE_MAGNITUDE = 1 << 62


def max_safe_magnitude(n: int) -> int:
    """Largest |integer| that encodes and decodes unambiguously modulo ``n``."""
    return n // 3 - 1


def validate_frac_bits(frac_bits: int) -> int:
    """Return ``frac_bits`` if it is a usable precision, else raise :class:`EncodingError`."""
    if isinstance(frac_bits, bool) or not isinstance(frac_bits, int | np.integer):
        raise EncodingError(f"frac_bits must be an int, got {type(frac_bits).__name__}")
    if not 0 <= frac_bits <= MAX_FRAC_BITS:
        raise EncodingError(f"frac_bits must be in [0, {MAX_FRAC_BITS}], got {frac_bits}")
    return int(frac_bits)


def encode_values(values: ArrayLike, frac_bits: int) -> list[int]:
    """Encode a 1-D array of reals to signed Python ints (round to nearest)."""
    validate_frac_bits(frac_bits)
    array = _as_finite_float_vector(values)
    if np.issubdtype(array.dtype, np.integer):
        return [int(v) << frac_bits for v in array.tolist()]
    scaled = np.rint(np.ldexp(array, frac_bits))
    if scaled.size and np.max(np.abs(scaled)) < _INT64_SAFE_MAGNITUDE:
        return scaled.astype(np.int64).tolist()
    return [int(v) for v in scaled.tolist()]


def decode_values(integers: Iterable[int], frac_bits: int) -> np.ndarray:
    """Decode signed integers back to float64 (exact division by 2**frac_bits, then rounding)."""
    validate_frac_bits(frac_bits)
    denominator = 1 << frac_bits
    decoded = []
    for position, value in enumerate(integers):
        try:
            decoded.append(int(value) / denominator)
        except OverflowError as exc:
            raise PaillierOverflowError(
                f"decoded value at position {position} does not fit in a float64"
            ) from exc
    return np.asarray(decoded, dtype=np.float64)


def to_plaintext(signed: int, n: int, *, position: int | None = None) -> int:
    """Map a signed integer into Z_n (negatives as n - |v|), refusing unsafe magnitudes."""
    if abs(signed) > max_safe_magnitude(n):
        where = "" if position is None else f" at position {position}"
        raise EncodingError(
            f"value{where} has {abs(signed).bit_length()} bits and exceeds the safe encoding "
            f"range of the {n.bit_length()}-bit key (|v| must be < n/3)"
        )
    return signed % n


def from_plaintext(plaintext: int, n: int, *, position: int | None = None) -> int:
    """Map a decrypted element of Z_n back to a signed integer, detecting overflow."""
    bound = max_safe_magnitude(n)
    if plaintext <= bound:
        return int(plaintext)
    if plaintext >= n - bound:
        return int(plaintext) - n
    where = "" if position is None else f" at position {position}"
    raise PaillierOverflowError(
        f"overflow detected in decoded value{where}: the plaintext lies in the band between the "
        "positive and negative ranges (|value| reached n/3), so a homomorphic result wrapped "
        "around; use fewer fractional bits, smaller inputs or a larger key"
    )


@dataclass(frozen=True)
class EncodedMatrix:
    """A plain matrix encoded once with ``frac_bits`` fractional bits (int64, rows x cols).

    Used as the exponent matrix of X^T [[d]]; int64 keeps it compact to ship to workers.
    """

    values: np.ndarray
    frac_bits: int

    def __post_init__(self) -> None:
        validate_frac_bits(self.frac_bits)
        if not isinstance(self.values, np.ndarray) or self.values.dtype != np.int64:
            raise EncodingError("EncodedMatrix.values must be an int64 numpy array")
        if self.values.ndim != 2:
            raise ShapeError(f"EncodedMatrix must be 2-D, got shape {self.values.shape}")
        if self.values.size and int(np.max(np.abs(self.values))) >= _INT64_SAFE_MAGNITUDE:
            raise EncodingError("EncodedMatrix entries must have magnitude < 2**62")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.values.shape[0]), int(self.values.shape[1]))

    def max_abs(self) -> int:
        """Largest |entry| as an int (0 for an empty matrix)."""
        return int(np.max(np.abs(self.values))) if self.values.size else 0


def encode_matrix(matrix: ArrayLike, frac_bits: int = MULTIPLIER_FRAC_BITS) -> EncodedMatrix:
    """Encode a real (or integer/boolean) matrix for use as plain multipliers."""
    validate_frac_bits(frac_bits)
    array = np.asarray(matrix)
    if array.ndim != 2:
        raise ShapeError(f"matrix must be 2-D, got shape {array.shape}")
    if array.dtype == bool:
        array = array.astype(np.int64)
    if np.issubdtype(array.dtype, np.integer):
        limit = _INT64_SAFE_MAGNITUDE >> frac_bits
        largest = max(abs(int(array.min())), abs(int(array.max()))) if array.size else 0
        if largest >= limit:
            raise EncodingError(f"integer matrix entries too large for frac_bits={frac_bits}")
        return EncodedMatrix(array.astype(np.int64) << frac_bits, frac_bits)
    array = array.astype(np.float64)
    if not np.all(np.isfinite(array)):
        row, col = np.argwhere(~np.isfinite(array))[0]
        raise EncodingError(f"matrix contains a non-finite value at row {row}, column {col}")
    scaled = np.rint(np.ldexp(array, frac_bits))
    if scaled.size and np.max(np.abs(scaled)) >= _INT64_SAFE_MAGNITUDE:
        raise EncodingError(
            f"matrix entries up to {np.max(np.abs(array)):.3g} do not fit 62 bits with "
            f"frac_bits={frac_bits}; lower frac_bits or rescale the features"
        )
    return EncodedMatrix(scaled.astype(np.int64), frac_bits)


def check_sum_of_products_fits(
    n: int, *, terms: int, max_abs_multiplier: int, max_abs_value: int
) -> int:
    """Raise :class:`PaillierOverflowError` unless sum_i x_i * d_i surely stays decodable.

    All arguments are in encoded (integer) units. Call it *before* computing X^T [[d]] or a
    subset sum: the party doing the computation cannot see the result, so only such an a-priori
    bound (rows x max|x| x max|d|) rules out a silent wrap-around. Returns the spare bits.
    """
    worst_case = max(terms, 0) * abs(max_abs_multiplier) * abs(max_abs_value)
    bound = max_safe_magnitude(n)
    if worst_case > bound:
        raise PaillierOverflowError(
            f"a sum of {terms} products with |multiplier| <= {max_abs_multiplier} and "
            f"|value| <= {max_abs_value} may reach {worst_case.bit_length()} bits, beyond the "
            f"{bound.bit_length()}-bit safe range of this key"
        )
    return bound.bit_length() - worst_case.bit_length()


def value_bound_to_integer(max_abs_value: float, frac_bits: int) -> int:
    """Encoded-unit bound matching a real bound: ceil(|max_abs_value| * 2**frac_bits)."""
    validate_frac_bits(frac_bits)
    if not np.isfinite(max_abs_value):
        raise EncodingError(f"max_abs_value must be finite, got {max_abs_value}")
    scaled = np.ldexp(abs(float(max_abs_value)), frac_bits)
    return int(np.ceil(scaled))


def _as_finite_float_vector(values: ArrayLike) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ShapeError(f"expected a 1-D vector of values, got shape {array.shape}")
    if array.dtype == bool:
        return array.astype(np.int64)
    if np.issubdtype(array.dtype, np.integer):
        return array
    if array.dtype == object:
        return _object_vector(array)
    array = array.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        raise EncodingError(f"value at position {int(bad[0])} is not finite ({array[bad[0]]})")
    return array


def _object_vector(array: np.ndarray) -> np.ndarray:
    """Object arrays (e.g. big Python ints) stay exact if all ints, else go through float."""
    if all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in array):
        ints = [int(v) for v in array]
        if all(abs(v) < _INT64_SAFE_MAGNITUDE for v in ints):
            return np.asarray(ints, dtype=np.int64)
        raise EncodingError("integer values must have magnitude < 2**62; encode big ints yourself")
    return _as_finite_float_vector(array.astype(np.float64))
