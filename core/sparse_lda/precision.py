"""Sparse estimates of the precision matrix Theta = Sigma^{-1} used for debiasing.

Both estimators return Theta in CLIME's orientation: column j approximates Sigma^{-1} e_j,
so ``Sigma_hat @ Theta ~ I`` and the debiasing correction is ``Theta^T @ residual``.

* CLIME (Cai, Liu & Luo 2011), what the paper's authors used: one L1 linear program per
  column, ``min ||theta||_1 s.t. ||Sigma_hat theta - e_j||_inf <= radius``.
* Nodewise lasso (Meinshausen & Buehlmann 2006; van de Geer et al. 2014): regress each
  feature on the others with a lasso. Same guarantee shape, ``||Sigma_hat theta_j - e_j||_inf
  <= penalty / tau_j^2``; at d = 200 it matched CLIME's aggregated accuracy in the paper's
  experiment while running about 40x faster than d LPs.

Regularisation (why there is a floor). Column j of the nodewise estimate is
``(e_j - gamma_j) / tau_j^2`` with ``tau_j^2`` the residual variance of feature j given the
others. At a site where feature j is nearly constant, or nearly a linear combination of other
features, ``tau_j^2`` is (numerically) zero and the column explodes: entries of 1e14 in the
debiased direction, which then dominate any average. ``tau_floor`` bounds ``tau_j^2`` below,
so ``|Theta_jk| <= (1 + ||gamma_j||_1) / tau_floor`` and the correction it drives is at most
that times the LP's residual radius. The price is a partial correction (shrunk towards the
biased LP estimate) for features whose conditional variance really is below the floor; a
shrunk correction costs a little bias, an exploding one costs the model.
"""

from __future__ import annotations

import numpy as np

from core.option_defaults import PrecisionMethod as PrecisionMethod  # defined there (light)
from core.sparse_lda.dantzig import solve_l1_dantzig


def clime_precision(covariance: np.ndarray, radius: float) -> np.ndarray:
    """CLIME: column j is ``argmin ||theta||_1 s.t. ||Sigma theta - e_j||_inf <= radius``."""
    identity = np.eye(covariance.shape[0])
    columns = [solve_l1_dantzig(covariance, unit, radius) for unit in identity]
    return np.column_stack(columns)


def nodewise_lasso_precision(
    centered_rows: np.ndarray, penalty: float, tau_floor: float = 0.0
) -> np.ndarray:
    """Nodewise lasso precision estimate from class-centred rows.

    For each feature j, ``gamma_j = argmin (1/2n)||x_j - X_{-j} g||^2 + penalty ||g||_1`` and
    ``tau_j^2 = max(x_j^T (x_j - X_{-j} gamma_j) / n, tau_floor)``; column j of Theta is
    ``(e_j - gamma_j) / tau_j^2`` (gamma_j padded with 0 at j). Above the floor this tau_j^2
    equals the textbook ``||residual||^2/n + penalty ||gamma_j||_1`` at the optimum, and it
    makes ``(Sigma_hat Theta)_jj = 1`` exactly.
    """
    from sklearn.linear_model import Lasso  # here: a second of start-up for processes without it

    n_rows, n_features = centered_rows.shape
    theta = np.zeros((n_features, n_features))
    regression = Lasso(alpha=penalty, fit_intercept=False, tol=1e-7, max_iter=20_000)
    for j in range(n_features):
        others = np.delete(np.arange(n_features), j)
        response = centered_rows[:, j]
        if n_features > 1:
            gamma = regression.fit(centered_rows[:, others], response).coef_
        else:
            gamma = np.zeros(0)
        residual = response - centered_rows[:, others] @ gamma
        tau_squared = max(float(response @ residual) / n_rows, tau_floor)
        if not tau_squared > 0:
            raise ValueError(f"feature {j} has zero residual variance and no floor was given")
        theta[j, j] = 1.0 / tau_squared
        theta[others, j] = -gamma / tau_squared
    return theta
