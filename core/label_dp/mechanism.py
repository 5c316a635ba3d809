"""The protocol every label-DP mechanism follows, and the loss of a finite channel.

A mechanism maps each of finitely many input label ``values`` to a random element of finitely
many ``outputs``; its ``transition_matrix`` (rows: inputs, columns: outputs) is the whole
privacy story: it is eps-label-DP exactly when every column's largest entry is at most
``e^eps`` times its smallest.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from core.label_dp.losses import LossName, pointwise_loss
from core.label_dp.randomness import RandomSource

_CHUNK_ENTRIES = 4_000_000


@runtime_checkable
class LabelMechanism(Protocol):
    """Local randomiser for labels, fixed before any label is seen."""

    values: np.ndarray
    outputs: np.ndarray
    epsilon: float
    loss: LossName

    def transition_matrix(self) -> np.ndarray:
        """``P(output j | input value i)``, shape ``(len(values), len(outputs))``."""
        ...

    def expected_loss(self, prior: np.ndarray | None = None) -> float:
        """``E loss(output, label)`` with labels drawn from ``prior`` (default: the own one)."""
        ...

    def randomize(self, labels: np.ndarray, rng: RandomSource = None) -> np.ndarray:
        """One independent noisy output per label (labels must be among ``values``)."""
        ...


def channel_expected_loss(
    matrix: np.ndarray,
    values: np.ndarray,
    outputs: np.ndarray,
    prior: np.ndarray,
    loss: LossName,
) -> float:
    """``sum_i prior_i sum_j matrix_ij loss(outputs_j, values_i)``, in row chunks."""
    rows_per_chunk = max(1, _CHUNK_ENTRIES // max(1, len(outputs)))
    total = 0.0
    for start in range(0, len(values), rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        losses = pointwise_loss(loss, outputs[None, :], values[rows, None])
        contributions = np.where(matrix[rows] > 0, matrix[rows] * losses, 0.0)
        total += float(prior[rows] @ contributions.sum(axis=1))
    return total


def privacy_loss(matrix: np.ndarray) -> float:
    """Largest ``log(max / min)`` over the columns: the exact epsilon of a finite channel."""
    column_max = matrix.max(axis=0)
    column_min = matrix.min(axis=0)
    used = column_max > 0
    if np.any(column_min[used] <= 0):
        return float("inf")
    return float(np.max(np.log(column_max[used]) - np.log(column_min[used])))
