"""Weighted means (FedAvg by row counts) and a scalar loss, computed with one secure sum.

Why pack everything into one vector: the parties send ``[w*update, w*loss, w]`` and only the
three sums are revealed, so the coordinator learns the weighted means and the total weight
but no single party's update, loss or row count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.secagg.errors import SecAggError


@dataclass(frozen=True)
class WeightedAggregate:
    """Weighted means recovered from a secure sum of packed vectors."""

    mean: np.ndarray
    mean_loss: float
    total_weight: float


def packed_dimension(update_dimension: int) -> int:
    """Length of the vector a party sends for an update of ``update_dimension`` entries."""
    return update_dimension + 2


def pack_weighted(update: np.ndarray, weight: float, loss: float = 0.0) -> np.ndarray:
    """Return ``[weight * update, weight * loss, weight]`` for secure summation."""
    vector = np.asarray(update, dtype=np.float64)
    if vector.ndim != 1:
        raise SecAggError(f"update must be a 1-D vector, got shape {vector.shape}")
    if not (np.isfinite(weight) and weight > 0):
        raise SecAggError(f"weight must be a positive finite number, got {weight!r}")
    if not np.isfinite(loss):
        raise SecAggError(f"loss must be finite, got {loss!r}")
    return np.concatenate([weight * vector, [weight * loss, weight]])


def unpack_weighted(total: np.ndarray) -> WeightedAggregate:
    """Turn the sum of packed vectors into weighted means."""
    vector = np.asarray(total, dtype=np.float64)
    if vector.ndim != 1 or vector.size < 2:
        raise SecAggError(f"packed sum must be a vector of length >= 2, got shape {vector.shape}")
    total_weight = float(vector[-1])
    if total_weight <= 0:
        raise SecAggError(f"total weight is {total_weight}; no party contributed a weight")
    return WeightedAggregate(
        mean=vector[:-2] / total_weight,
        mean_loss=float(vector[-2]) / total_weight,
        total_weight=total_weight,
    )
