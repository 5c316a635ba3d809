"""The L1-minimisation linear program shared by the LDA direction and CLIME.

Both estimators solve ``min ||b||_1  s.t.  ||A b - t||_inf <= radius`` (a Dantzig-selector
form): the LDA direction with ``A = Sigma_hat, t = mu1_hat - mu2_hat``, a CLIME column with
``t = e_j``. Writing ``b = u - v`` with ``u, v >= 0`` makes it a linear program that HiGHS
solves exactly (to its tolerances), with no tuning of step sizes.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import linprog

# the paper's Dantzig radius scale, defined beside the other option defaults
from core.option_defaults import DEFAULT_DIRECTION_RADIUS_SCALE as DEFAULT_DIRECTION_RADIUS_SCALE
from core.sparse_lda.errors import InfeasibleProgramError

_FEASIBLE_STATUS = 0
_INFEASIBLE_STATUS = 2


def scaled_radius(scale: float, n_features: int, n_rows: int) -> float:
    """``scale * sqrt(log d / n)``: the statistical error level of a sample covariance entry."""
    return scale * math.sqrt(math.log(n_features) / n_rows)


def solve_l1_dantzig(matrix: np.ndarray, target: np.ndarray, radius: float) -> np.ndarray:
    """Solve ``min ||b||_1 s.t. ||matrix @ b - target||_inf <= radius`` with HiGHS."""
    if radius < 0:
        raise ValueError(f"constraint radius must be non-negative, got {radius}")
    n = target.shape[0]
    # Rows: matrix (u - v) <= radius + target  and  -matrix (u - v) <= radius - target.
    constraints = np.block([[matrix, -matrix], [-matrix, matrix]])
    bounds = np.concatenate([radius + target, radius - target])
    result = linprog(
        c=np.ones(2 * n), A_ub=constraints, b_ub=bounds, bounds=(0, None), method="highs"
    )
    if result.status == _INFEASIBLE_STATUS:
        raise InfeasibleProgramError(
            f"no b satisfies ||A b - t||_inf <= {radius:.4g}; the radius is too small for this "
            "(possibly singular) covariance: increase the radius scale or add rows"
        )
    if result.status != _FEASIBLE_STATUS:
        raise RuntimeError(f"HiGHS did not solve the L1 program: {result.message}")
    return result.x[:n] - result.x[n:]
