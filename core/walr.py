"""WALR: logistic regression from one noisy label-weighted sum (label differential privacy).

The logistic-loss gradient is (1/N) sum_i sigmoid(theta.z_i) z_i - (1/N) sum_i y_i z_i. Only the
second term touches the labels and it does not depend on theta, so the label owner releases
s = sum_i y_i z_i once, with Gaussian noise, and the feature owner trains in the clear. Here
z_i = [x_i, 1] when an intercept is fitted (the intercept entry of s is the positive count).

Privacy model: the features are known to whoever trains; one person's *label* is private.
Changing one label moves s by +-z_i, so the L2 sensitivity is max ||z_i||:

* binary mode: x_i in {0,1}^k, sensitivity sqrt(k), or sqrt(k + 1) with the intercept;
* clipped mode: rows scaled to L2 norm <= C, sensitivity C, or sqrt(C^2 + 1) with the intercept.

The grid: every feature value is a multiple of ``granularity`` (1 for binary features; a power
of two 2^-16 to 2^-17 of C for clipped ones, rounding toward zero so no norm grows). The sum is
then an exact integer number of grid steps; ``release_noise`` adds exact discrete-Gaussian steps
and multiplies back by the power of two, so no floating-point rounding ever depends on the
labels (the Mironov 2012 attack needs such rounding). The sum also fits integer encodings, e.g.
for a Paillier computation of it.

Calibration (``walr_sigma``) accounts for the *discrete* noise actually drawn: the exact delta for
binary shifts in binary mode, the discrete Gaussian's zCDP bound in clipped mode
(see :mod:`core.dp.discrete_privacy`). Training after the release is post-processing.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np
import pandas as pd
from scipy.optimize import minimize
from scipy.special import expit

from core.dp.discrete_privacy import binary_shift_sigma, zcdp_sigma
from core.dp.gaussian import validate_epsilon_delta
from core.dp.samplers import sample_discrete_gaussian, to_exact_fraction

__all__ = [
    "PrivacyWarning",
    "WalrFeatures",
    "WalrFit",
    "WalrInputError",
    "fit_walr",
    "label_weighted_sum",
    "prepare_binary_features",
    "prepare_clipped_features",
    "release_noise",
    "validate_labels",
    "walr_sigma",
]

GRID_STEPS_PER_CLIP = 16  # clipped features use at least 2^16 grid steps per unit of C
CONVERGED_GRADIENT = 1e-6  # max |gradient| of the (1/N-scaled) objective at a converged fit


class WalrInputError(ValueError):
    """Bad features, labels or release input; the message names the column and 1-based row."""


class PrivacyWarning(UserWarning):
    """A parameter choice that is allowed but weakens the privacy guarantee."""


@dataclass(frozen=True)
class WalrFeatures:
    """Features ready for WALR: values on an exact power-of-two grid with a known row bound."""

    values: np.ndarray  # (N, k) float64; every entry is an integer multiple of granularity
    column_names: tuple[str, ...]
    granularity: float
    row_norm_bound: float  # bound on ||x_i||_2 without the intercept
    fit_intercept: bool
    mode: Literal["binary", "clipped"]

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of sum_i y_i z_i to one label; the intercept entry adds 1^2."""
        return math.hypot(self.row_norm_bound, 1.0 if self.fit_intercept else 0.0)

    @property
    def n_rows(self) -> int:
        return int(self.values.shape[0])

    def design_matrix(self) -> np.ndarray:
        """z_i: the feature row with a trailing 1 when the intercept is fitted."""
        if not self.fit_intercept:
            return self.values
        return np.hstack([self.values, np.ones((self.n_rows, 1))])

    def grid_units(self) -> np.ndarray:
        """The design matrix in grid steps, as exact int64 (for integer encodings)."""
        return np.rint(self.design_matrix() / self.granularity).astype(np.int64)


@dataclass(frozen=True)
class WalrFit:
    """A trained model: P(y = 1 | x) = sigmoid(x . coef + intercept)."""

    coef: np.ndarray
    intercept: float
    converged: bool
    n_iter: int

    def decision_function(self, features: np.ndarray) -> np.ndarray:
        return np.asarray(features, dtype=np.float64) @ self.coef + self.intercept

    def predict_proba(self, features: np.ndarray) -> np.ndarray:
        """Probability of the positive class for each row."""
        return expit(self.decision_function(features))


# ------------------------------------------------------------------------ input checks


def _as_matrix(features: np.ndarray | pd.DataFrame) -> tuple[np.ndarray, tuple[str, ...]]:
    if isinstance(features, pd.DataFrame):
        names = tuple(str(c) for c in features.columns)
        for name, column in features.items():
            if not (pd.api.types.is_numeric_dtype(column) or pd.api.types.is_bool_dtype(column)):
                raise WalrInputError(f"column {name!r}: not numeric (dtype {column.dtype})")
        matrix = features.to_numpy(dtype=np.float64)
    else:
        array = np.asarray(features)
        if array.ndim != 2:
            raise WalrInputError(f"features must be a 2-D table, got shape {array.shape}")
        if not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
            raise WalrInputError(f"features must be numeric, got dtype {array.dtype}")
        matrix = array.astype(np.float64)
        names = tuple(f"x{j}" for j in range(matrix.shape[1]))
    if matrix.shape[0] == 0 or matrix.shape[1] == 0:
        raise WalrInputError(f"features must have rows and columns, got shape {matrix.shape}")
    _refuse_where(~np.isfinite(matrix), names, "is missing or not finite", matrix)
    return matrix, names


def _plain(value: object) -> object:
    """numpy scalars as plain Python values, so messages read 2.0 rather than np.float64(2.0)."""
    return value.item() if isinstance(value, np.generic) else value


def _refuse_where(
    bad: np.ndarray, names: tuple[str, ...], problem: str, matrix: np.ndarray
) -> None:
    """Raise for the first offending cell in row order, naming its column and 1-based row."""
    if not bad.any():
        return
    row, column = np.argwhere(bad)[0]
    raise WalrInputError(
        f"column {names[column]!r}, row {row + 1}: value {_plain(matrix[row, column])!r} {problem}"
    )


def validate_labels(labels: np.ndarray | pd.Series, n_rows: int | None = None) -> np.ndarray:
    """Return labels as int64 after checking they are 0/1 (naming the first bad row)."""
    array = np.asarray(labels)
    if array.ndim != 1:
        raise WalrInputError(f"labels must be one-dimensional, got shape {array.shape}")
    if n_rows is not None and array.size != n_rows:
        raise WalrInputError(f"got {array.size} labels for {n_rows} feature rows")
    if array.dtype.kind in "biuf":
        bad_rows = np.flatnonzero(~np.isin(array.astype(np.float64), (0.0, 1.0))).tolist()
    else:  # object or text: only genuine numbers 0 and 1 are labels
        bad_rows = [
            i
            for i, v in enumerate(array)
            if not (isinstance(v, int | float | np.number) and v in (0, 1))
        ]
    if bad_rows:
        row = bad_rows[0]
        raise WalrInputError(f"label, row {row + 1}: value {_plain(array[row])!r} is not 0 or 1")
    return array.astype(np.float64).astype(np.int64)


# ------------------------------------------------------------------------ features


def prepare_binary_features(
    features: np.ndarray | pd.DataFrame, *, fit_intercept: bool = True
) -> WalrFeatures:
    """Accept 0/1 features only (sensitivity sqrt(k), plus 1 for the intercept)."""
    matrix, names = _as_matrix(features)
    _refuse_where((matrix != 0) & (matrix != 1), names, "is not binary (0 or 1)", matrix)
    return WalrFeatures(
        values=matrix,
        column_names=names,
        granularity=1.0,
        row_norm_bound=math.sqrt(matrix.shape[1]),
        fit_intercept=fit_intercept,
        mode="binary",
    )


def default_granularity(clip_norm: float) -> float:
    """Power of two with 2^16 to 2^17 steps per C (never above 1, so the intercept is on it)."""
    exponent = math.floor(math.log2(clip_norm)) - GRID_STEPS_PER_CLIP
    return 2.0 ** min(exponent, 0)


def prepare_clipped_features(
    features: np.ndarray | pd.DataFrame, clip_norm: float, *, fit_intercept: bool = True
) -> WalrFeatures:
    """Scale each row to L2 norm <= clip_norm and put it on a power-of-two grid.

    Only the features are looked at, so clip_norm may be chosen from them (e.g. a quantile of
    row norms) without touching the label privacy budget.
    """
    if not (isinstance(clip_norm, int | float) and math.isfinite(clip_norm) and clip_norm > 0):
        raise WalrInputError(f"clip_norm must be finite and > 0, got {clip_norm!r}")
    matrix, names = _as_matrix(features)
    step = default_granularity(float(clip_norm))
    norms = np.linalg.norm(matrix, axis=1)
    shrink = np.minimum(1.0, clip_norm / np.maximum(norms, np.finfo(float).tiny))
    steps = np.trunc(matrix * shrink[:, None] / step).astype(np.int64)
    _enforce_norm_in_steps(steps, Fraction(clip_norm) / Fraction(step))
    return WalrFeatures(
        values=steps.astype(np.float64) * step,
        column_names=names,
        granularity=step,
        row_norm_bound=float(clip_norm),
        fit_intercept=fit_intercept,
        mode="clipped",
    )


def _enforce_norm_in_steps(steps: np.ndarray, bound: Fraction) -> None:
    """Make every row satisfy ||row||^2 <= bound^2 exactly (undo float rounding in clipping)."""
    limit = bound * bound
    squared = (steps * steps).sum(axis=1)
    for row in np.flatnonzero(squared > math.floor(limit)):
        while int((steps[row] * steps[row]).sum()) > limit:
            largest = int(np.argmax(np.abs(steps[row])))
            steps[row, largest] -= np.sign(steps[row, largest])


# ------------------------------------------------------------------------ release


def label_weighted_sum(features: WalrFeatures, labels: np.ndarray | pd.Series) -> np.ndarray:
    """sum_i y_i z_i in plaintext, exactly (integer grid steps, scaled back by a power of two).

    The reference for the encrypted computation, which must produce the same vector.
    """
    checked = validate_labels(labels, features.n_rows)
    return (checked @ features.grid_units()).astype(np.float64) * features.granularity


def walr_sigma(epsilon: float, delta: float, features: WalrFeatures) -> float:
    """Noise sigma (in feature units) making the release (epsilon, delta)-label-DP.

    Warns when delta >= 1/N: such a delta allows releasing one person's label outright.
    """
    validate_epsilon_delta(epsilon, delta)
    if delta >= 1.0 / features.n_rows:
        warnings.warn(
            f"delta={delta!r} is not below 1/N = 1/{features.n_rows}; use delta well below "
            "1/N (e.g. 1/N^1.1)",
            PrivacyWarning,
            stacklevel=2,
        )
    if features.mode == "binary":
        max_ones = features.values.shape[1] + int(features.fit_intercept)
        return binary_shift_sigma(epsilon, delta, max_ones)
    sensitivity_steps = features.sensitivity / features.granularity
    return zcdp_sigma(epsilon, delta, sensitivity_steps) * features.granularity


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def release_noise(
    sum_vector: np.ndarray,
    sigma: float,
    granularity: float = 1.0,
    *,
    noise: bool = True,
    testing: bool = False,
) -> np.ndarray:
    """Add exact discrete Gaussian noise, sigma in value units, on the given grid.

    ``sum_vector`` must hold exact multiples of ``granularity`` (what ``label_weighted_sum``
    and an integer-encoded encrypted sum produce); anything else is refused, because rounding
    it here would make the result depend on low-order bits. ``noise=False`` returns the exact
    sum and is refused unless ``testing=True`` as well.
    """
    values = np.asarray(sum_vector, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise WalrInputError(f"sum_vector must be a non-empty 1-D array, got {values.shape}")
    step = to_exact_fraction(granularity, "granularity")
    if not (_is_power_of_two(step.numerator) and _is_power_of_two(step.denominator)):
        raise WalrInputError(f"granularity must be a power of two, got {granularity!r}")
    units = values / float(step)
    off_grid = ~np.isfinite(units) | (units != np.rint(units)) | (np.abs(units) >= 2.0**53)
    if off_grid.any():
        entry = int(np.flatnonzero(off_grid)[0])
        raise WalrInputError(
            f"sum_vector entry {entry}: {_plain(values[entry])!r} is not an exact multiple of the "
            f"granularity {granularity!r} (below 2^53 steps)"
        )
    if not noise:
        if not testing:
            raise WalrInputError("noise=False is only allowed together with testing=True")
        return values.copy()
    steps = sample_discrete_gaussian(to_exact_fraction(sigma, "sigma") / step, values.size)
    return (np.rint(units).astype(np.int64) + steps).astype(np.float64) * float(step)


# ------------------------------------------------------------------------ training


def fit_walr(
    features: np.ndarray,
    noisy_sum: np.ndarray,
    n_rows: int,
    l2: float,
    fit_intercept: bool = True,
) -> WalrFit:
    """Minimise (1/N) sum_i log(1 + exp(theta.z_i)) - theta.s/N + l2/2 ||w||^2 with L-BFGS.

    The intercept is not penalised (as in scikit-learn, whose LogisticRegression(C=1/(N l2))
    solves the same problem given the true sum). If the noisy positive count falls outside
    (0, N) no finite minimiser exists; it is moved to [1/2, N - 1/2], which is post-processing.
    """
    matrix = np.asarray(features, dtype=np.float64)
    if matrix.ndim != 2:
        raise WalrInputError(f"features must be 2-D, got shape {matrix.shape}")
    if n_rows != matrix.shape[0]:
        raise WalrInputError(f"n_rows={n_rows} but features have {matrix.shape[0]} rows")
    if not (math.isfinite(l2) and l2 > 0):
        raise WalrInputError(f"l2 must be finite and > 0 (noisy sums need it), got {l2!r}")
    width = matrix.shape[1] + int(fit_intercept)
    target = np.array(noisy_sum, dtype=np.float64)
    if target.shape != (width,) or not np.isfinite(target).all():
        raise WalrInputError(f"noisy_sum must be {width} finite numbers, got {target.shape}")
    if fit_intercept:
        target[-1] = min(max(target[-1], 0.5), n_rows - 0.5)
        matrix = np.hstack([matrix, np.ones((n_rows, 1))])
    penalty = np.ones(width)
    if fit_intercept:
        penalty[-1] = 0.0

    def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
        scores = matrix @ theta
        loss = (np.logaddexp(0.0, scores).sum() - theta @ target) / n_rows
        loss += 0.5 * l2 * float(penalty @ (theta * theta))
        gradient = (matrix.T @ expit(scores) - target) / n_rows + l2 * penalty * theta
        return float(loss), gradient

    result = minimize(
        objective,
        np.zeros(width),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 10_000, "gtol": 1e-10, "ftol": 1e-15},
    )
    theta = result.x
    # L-BFGS-B often stops with "ABNORMAL" once float precision, not the optimum, limits the
    # line search; judge convergence by the gradient itself.
    converged = bool(np.abs(objective(theta)[1]).max() <= CONVERGED_GRADIENT)
    coef = theta[:-1] if fit_intercept else theta
    intercept = float(theta[-1]) if fit_intercept else 0.0
    return WalrFit(coef=coef, intercept=intercept, converged=converged, n_iter=int(result.nit))
