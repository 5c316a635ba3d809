"""Input checks shared by every mechanism, with messages that point at the bad entry."""

from __future__ import annotations

import math

import numpy as np

from core.label_dp.errors import InvalidEpsilonError, InvalidLabelError, InvalidPriorError
from core.label_dp.losses import LossName


def check_epsilon(epsilon: float, name: str = "epsilon") -> float:
    """``epsilon`` as a float if it is finite and positive."""
    try:
        value = float(epsilon)
    except (TypeError, ValueError):
        raise InvalidEpsilonError(f"{name} must be a number; got {epsilon!r}") from None
    if not math.isfinite(value) or value <= 0.0:
        raise InvalidEpsilonError(f"{name} must be finite and > 0; got {epsilon!r}")
    return value


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def check_values(values: object, loss: LossName) -> np.ndarray:
    """Label values as a float array: 1-D, non-empty, finite, strictly increasing."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise InvalidPriorError(f"values must be a non-empty 1-D array; got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        bad = _first(~np.isfinite(array))
        raise InvalidPriorError(f"values[{bad}] is {array[bad]}; values must be finite")
    if np.any(np.diff(array) <= 0):
        bad = _first(np.diff(array) <= 0) + 1
        raise InvalidPriorError(
            f"values must be strictly increasing; values[{bad}] = {array[bad]} "
            f"follows {array[bad - 1]}"
        )
    if loss == "poisson" and array[0] < 0:
        raise InvalidPriorError(f"poisson loss needs values >= 0; values[0] = {array[0]}")
    return array


def check_prior(probs: object, size: int, name: str = "probs") -> np.ndarray:
    """Non-negative finite weights of length ``size``, normalised to sum to one."""
    array = np.asarray(probs, dtype=np.float64)
    if array.shape != (size,):
        raise InvalidPriorError(f"{name} must have shape ({size},) like values; got {array.shape}")
    bad_mask = ~np.isfinite(array) | (array < 0)
    if np.any(bad_mask):
        bad = _first(bad_mask)
        raise InvalidPriorError(f"{name}[{bad}] is {array[bad]}; weights must be finite and >= 0")
    total = float(array.sum())
    if total <= 0.0:
        raise InvalidPriorError(f"{name} sums to {total}; at least one weight must be positive")
    return array / total


def positions_on_grid(values: np.ndarray, labels: object) -> np.ndarray:
    """Index of every label in the sorted ``values``; labels must be exactly on the grid."""
    array = np.asarray(labels, dtype=np.float64)
    if array.ndim != 1:
        raise InvalidLabelError(f"labels must be 1-D; got shape {array.shape}")
    if array.size == 0:
        raise InvalidLabelError("labels are empty")
    if np.any(np.isnan(array)):
        bad = _first(np.isnan(array))
        raise InvalidLabelError(f"labels[{bad}] is NaN")
    positions = np.minimum(np.searchsorted(values, array), len(values) - 1)
    off_grid = values[positions] != array
    if np.any(off_grid):
        bad = _first(off_grid)
        raise InvalidLabelError(
            f"labels[{bad}] = {array[bad]} is not one of the mechanism's {len(values)} values "
            f"(range [{values[0]}, {values[-1]}]); snap labels to the grid first"
        )
    return positions
