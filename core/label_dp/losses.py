"""The three regression losses the mechanisms optimise, as plain vectorised functions.

The Poisson loss is the unit deviance ``v - y + y log(y / v)`` (half of scikit-learn's
``mean_poisson_deviance``). It differs from the log-likelihood ``v - y log v`` only by a term in
``y``, so it has the same minimisers, but it is zero at ``v == y`` and monotone in ``y`` on each
side of ``v``, as the optimality theorem for RR-on-Bins requires.
"""

from __future__ import annotations

import numpy as np

from core.label_dp.errors import UnknownLossError
from core.option_defaults import LOSS_NAMES, LossName


def check_loss(loss: str) -> LossName:
    """Return ``loss`` if supported, else raise naming the accepted values."""
    if loss not in LOSS_NAMES:
        raise UnknownLossError(f"loss must be one of {', '.join(LOSS_NAMES)}; got {loss!r}")
    return loss  # type: ignore[return-value]


def pointwise_loss(loss: LossName, predicted: np.ndarray, label: np.ndarray) -> np.ndarray:
    """``loss(predicted, label)`` elementwise with numpy broadcasting."""
    predicted = np.asarray(predicted, dtype=np.float64)
    label = np.asarray(label, dtype=np.float64)
    if loss == "squared":
        return (predicted - label) ** 2
    if loss == "absolute":
        return np.abs(predicted - label)
    if loss == "poisson":
        with np.errstate(divide="ignore", invalid="ignore"):
            from scipy.special import xlogy  # SciPy only where a loss is computed

            return predicted - label + xlogy(label, label) - xlogy(label, predicted)
    raise UnknownLossError(f"loss must be one of {', '.join(LOSS_NAMES)}; got {loss!r}")
