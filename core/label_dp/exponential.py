"""Baseline: the exponential mechanism over the grid with utility ``-loss(output, label)``.

``P(output o | label y)`` is proportional to ``exp(-beta * loss(o, y))``. The textbook
``beta = eps / (2 * Delta_u)`` (``Delta_u``: the largest change of one output's loss between
two labels) is always safe but loose; the finite transition matrix lets us measure the real
privacy loss, so ``beta`` is raised by bisection as far as the measured loss stays within
``eps``. The matrix is then sampled exactly from integer weights (see ``channel``).

For Poisson loss an output of 0 would have infinite loss for every positive label (and so
probability 0, breaking DP), so non-positive grid values are replaced by half the smallest
positive one.
"""

from __future__ import annotations

import numpy as np
from scipy.special import softmax

from core.label_dp.channel import FiniteMechanism, QuantisedChannel
from core.label_dp.losses import LossName, check_loss, pointwise_loss
from core.label_dp.mechanism import privacy_loss
from core.label_dp.validation import check_epsilon, check_prior, check_values

CALIBRATION_MARGIN = 1e-9  # relative slack left for rounding to integer weights
_BISECTION_STEPS = 40


def exponential_outputs(values: np.ndarray, loss: LossName) -> np.ndarray:
    """The grid itself, except that Poisson outputs must be positive."""
    positive = values[values > 0]
    if loss != "poisson" or positive.size in (0, values.size):
        return values.copy()
    return np.maximum(values, positive[0] / 2.0)


def exponential_matrix(losses: np.ndarray, beta: float) -> np.ndarray:
    """Rows ``softmax(-beta * losses[i])``: the exponential mechanism at inverse temperature."""
    return softmax(-beta * losses, axis=1)


def calibrated_beta(losses: np.ndarray, epsilon: float) -> float:
    """The largest verified ``beta`` in ``[textbook, 2 * textbook]`` whose loss is ``<= eps``."""
    sensitivity = float(np.max(losses.max(axis=0) - losses.min(axis=0)))
    if sensitivity == 0.0:
        return 0.0
    safe = epsilon / (2.0 * sensitivity)
    low, high = safe, 2.0 * safe
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2.0
        if privacy_loss(exponential_matrix(losses, middle)) <= epsilon:
            low = middle
        else:
            high = middle
    return low


def exponential_mechanism(
    values: object, epsilon: float, loss: str, prior: object | None = None
) -> FiniteMechanism:
    """The calibrated exponential mechanism for labels on the grid ``values``."""
    loss_name = check_loss(loss)
    grid = check_values(values, loss_name)
    eps = check_epsilon(epsilon)
    weights = check_prior(np.ones(len(grid)) if prior is None else prior, len(grid), "prior")
    outputs = exponential_outputs(grid, loss_name)
    losses = pointwise_loss(loss_name, outputs[None, :], grid[:, None])
    target = eps * (1.0 - CALIBRATION_MARGIN)
    matrix = exponential_matrix(losses, calibrated_beta(losses, target))
    channel = QuantisedChannel.from_matrix(matrix, eps)
    return FiniteMechanism("exponential", grid, outputs, eps, loss_name, weights, channel)
