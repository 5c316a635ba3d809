"""Fit the feature holder's model on noisy labels (post-processing: costs no privacy).

One scikit-learn estimator per loss, matching what RR-on-Bins optimised for: ridge for
squared loss, Poisson regression (log link) for Poisson loss, median regression for absolute
loss. Features are standardised inside the returned pipeline so one regularisation strength
suits features of any scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from core.label_dp.errors import InvalidLabelError
from core.label_dp.losses import check_loss

if TYPE_CHECKING:
    from sklearn.pipeline import Pipeline

RIDGE_ALPHA = 1.0
POISSON_ALPHA = 1e-4
POISSON_MAX_ITER = 1_000


def _estimator(loss: str) -> object:
    # scikit-learn is imported where it is used: it costs about a second at every start of a
    # party's or a worker's process, most of which never train on noisy labels
    from sklearn.linear_model import PoissonRegressor, QuantileRegressor, Ridge

    if loss == "squared":
        return Ridge(alpha=RIDGE_ALPHA)
    if loss == "poisson":
        return PoissonRegressor(alpha=POISSON_ALPHA, max_iter=POISSON_MAX_ITER)
    return QuantileRegressor(quantile=0.5, alpha=0.0, solver="highs")


def train_on_noisy_labels(X: object, noisy_y: object, loss: str) -> Pipeline:
    """A fitted ``StandardScaler`` + regressor pipeline for ``loss`` on ``(X, noisy_y)``."""
    loss_name = check_loss(loss)
    features = np.asarray(X, dtype=np.float64)
    labels = np.asarray(noisy_y, dtype=np.float64)
    if features.ndim != 2 or features.shape[0] == 0:
        raise InvalidLabelError(f"X must be a non-empty 2-D array; got shape {features.shape}")
    if labels.shape != (features.shape[0],):
        raise InvalidLabelError(
            f"noisy_y must have shape ({features.shape[0]},) to match X; got {labels.shape}"
        )
    for name, array in (("X", features), ("noisy_y", labels)):
        if not np.all(np.isfinite(array)):
            row = int(np.flatnonzero(~np.isfinite(array.reshape(len(array), -1)).any(axis=1))[0])
            raise InvalidLabelError(f"{name} has a NaN or infinite value in row {row}")
    if loss_name == "poisson" and (labels.min() < 0 or labels.sum() <= 0):
        raise InvalidLabelError("poisson loss needs noisy_y >= 0 with a positive sum")
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), _estimator(loss_name)).fit(features, labels)
