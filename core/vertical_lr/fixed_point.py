"""The fixed-point integers every party computes with, so encrypted and plain runs agree.

Paillier adds and multiplies integers exactly, so if every party rounds its floats to
integers in the same documented way, the encrypted protocol computes *exactly* the integers
that :mod:`core.vertical_lr.reference` computes in the clear. The only error against
floating-point training is this rounding (2^-20 for features, 2^-24 for residuals).
"""

from __future__ import annotations

import numpy as np

FEATURE_BITS = 20  # features x are sent nowhere; they multiply ciphertexts as round(x * 2^20)
RESIDUAL_BITS = 24  # residual terms u/4 and y/2 are encrypted as round(v * 2^24)
GRADIENT_BITS = FEATURE_BITS + RESIDUAL_BITS
_MAX_FEATURE = 2.0 ** (62 - FEATURE_BITS - 12)  # leaves head room for sums of 4096 products
MAX_FEATURE_INT = int(_MAX_FEATURE) << FEATURE_BITS  # 2^50: every |x_int| (packing's margin)
# A residual term is u/4 or u/4 - y/2 for a party's score u: beyond 2^16 the model has long
# diverged (the logistic loss saturates at |u| ~ 40), and the bound is what lets masked
# gradients share a plaintext (core.vertical_lr.packing).
_MAX_RESIDUAL = 2.0**16
MAX_RESIDUAL_INT = int(_MAX_RESIDUAL) << RESIDUAL_BITS  # 2^40: every |residual term|


class FixedPointRangeError(ValueError):
    """A value is too large for the fixed-point encoding (standardise the features)."""


class ResidualRangeError(FixedPointRangeError):
    """A score share beyond the residual bound: the model has diverged."""


def encode_features(X: np.ndarray, column_names: list[str] | None = None) -> np.ndarray:
    """Features as int64 ``round(x * 2^FEATURE_BITS)``; refuses values that could overflow."""
    X = np.asarray(X, dtype=float)
    too_big = np.abs(X) > _MAX_FEATURE
    if too_big.any():
        row, col = map(int, np.argwhere(too_big)[0])
        name = column_names[col] if column_names else f"#{col}"
        raise FixedPointRangeError(
            f"feature {name} at row {row + 1} is {X[row, col]:g}; |x| must stay below "
            f"{_MAX_FEATURE:g} for exact fixed-point arithmetic (standardise the column)"
        )
    return np.rint(X * 2.0**FEATURE_BITS).astype(np.int64)


def encode_residual(values: np.ndarray) -> list[int]:
    """Residual terms as Python ints ``round(v * 2^RESIDUAL_BITS)``; refuses ``|v| > 2^16``."""
    values = np.asarray(values, dtype=float)
    if values.size and not np.abs(values).max() <= _MAX_RESIDUAL:  # NaN fails too
        worst = values.flat[int(np.nanargmax(np.where(np.isnan(values), np.inf, np.abs(values))))]
        raise ResidualRangeError(
            f"a residual term is {worst:g}; |u/4 - y/2| must stay within {_MAX_RESIDUAL:g} for "
            "exact fixed-point arithmetic"
        )
    return [int(v) for v in np.rint(values * 2.0**RESIDUAL_BITS)]


def decode_gradient(sums: list[int], n_rows: int) -> np.ndarray:
    """``X^T d`` integers at GRADIENT_BITS, averaged over the batch."""
    return np.array([s / 2.0**GRADIENT_BITS for s in sums], dtype=float) / n_rows
