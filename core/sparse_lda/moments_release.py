"""Row-level DP: noisy clipped sufficient statistics, summed securely, then one pooled fit.

Why this mechanism (and not output perturbation of the local fits). LDA needs only the class
sums, class counts and the second-moment matrix, and these are sums over rows: clip each
row to ``||x|| <= R`` and one row moves a party's statistics by at most about
``sqrt(2 R^4 + 2 R^2 w^2)`` (exactly: :func:`core.sparse_lda.privacy.row_sensitivity`), a
bound that is exact algebra, holds for any rows and labels, and does not depend on how many
rows or how rare a class is. The secure sum adds the parties' statistics and noise shares, so the
coordinator sees only ``statistics of all N rows + N(0, sigma^2)`` and fits the sparse
discriminant on them (post-processing); the noise on the covariance is sigma / N, falling as
rows grow, whatever the number of parties.

The alternative the issue names, output perturbation of a ridge-augmented local direction
(Jayaraman, Wang, Evans & Gu 2018), needs the Lipschitz constant of the local fit in one
row. For the LDA objective ``1/2 b^T (Sigma_hat + gamma I) b - mu_d^T b + lambda ||b||_1`` on a
ball ``||b|| <= B``, strong convexity gives ``||Delta b|| <= (||Delta Sigma_hat|| B +
||Delta mu_d||) / gamma`` with ``||Delta Sigma_hat|| <= 4 R^2 / n`` and ``||Delta mu_d|| <=
2R / (n_min - 1)``. With ``R^2 ~ d`` (standardised rows) that is ``4 d B / (n gamma)`` per
party, about 20 / gamma at the paper's d = 200, n = 200, B = 5, before the debiasing step
(whose precision estimate needs a bound of its own); the noise then exceeds the signal
unless gamma is so large that the fit is mostly ridge, and the ``1 / n_min`` term makes a site
with a rare class set the noise for everyone. The moments release pays ``R^2 / N`` per
covariance entry instead, with no dependence on classes or on the local fit.

Cost: the vector has ``d (d + 1) / 2 + 2 d + 2`` entries (20,502 at d = 200), more traffic
than the party-level release's 3d, but each party sends it once.
"""

from __future__ import annotations

import math

import numpy as np

from core.sparse_lda.dantzig import scaled_radius, solve_l1_dantzig
from core.sparse_lda.errors import InfeasibleProgramError, MissingClassError, ShapeError
from core.sparse_lda.local_fit import DIRECTION_RIDGE_FRACTION, LocalFitSettings, typical_variance
from core.sparse_lda.model import LinearDiscriminant
from core.sparse_lda.party_data import (
    MIN_ROWS_PER_CLASS,
    NEGATIVE_LABEL,
    POSITIVE_LABEL,
    PartyData,
)
from core.sparse_lda.privacy import (
    PrivacySettings,
    PrivacyUnit,
    release_dimension,
    round_to_grid,
)

NOISE_RIDGE_SCALE = 0.1
"""The pooled covariance gets ``+ 0.1 ||E||`` on its diagonal, E the noise matrix whose
spectral norm ``sqrt(2 d) sigma_entry`` is public (semicircle law). Keeps the LP well posed
when noise pushes eigenvalues down; 0.1 was best of 0.1 / 0.3 / 0.5 / 1 on the paper's design."""


def clip_rows(features: np.ndarray, radius: float) -> np.ndarray:
    """Scale every row with ``||x|| > radius`` back onto the sphere of that radius."""
    norms = np.linalg.norm(features, axis=1)
    factors = np.minimum(1.0, radius / np.maximum(norms, np.finfo(float).tiny))
    return features * factors[:, None]


def pack_symmetric(matrix: np.ndarray) -> np.ndarray:
    """Upper triangle, row by row, off-diagonal entries times sqrt(2): L2 norm = Frobenius."""
    rows, cols = np.triu_indices(matrix.shape[0])
    weights = np.where(rows == cols, 1.0, math.sqrt(2.0))
    return matrix[rows, cols] * weights


def unpack_symmetric(packed: np.ndarray, n_features: int) -> np.ndarray:
    """Inverse of :func:`pack_symmetric`."""
    rows, cols = np.triu_indices(n_features)
    if packed.shape != rows.shape:
        raise ShapeError(f"packed matrix has {packed.shape[0]} entries, expected {rows.size}")
    values = packed / np.where(rows == cols, 1.0, math.sqrt(2.0))
    matrix = np.zeros((n_features, n_features))
    matrix[rows, cols] = values
    matrix[cols, rows] = values
    return matrix


def _check_row_unit(settings: PrivacySettings) -> None:
    if settings.unit is not PrivacyUnit.ROW:
        raise ValueError("the moments release needs row-level privacy settings")
    if settings.two_rounds:
        raise ValueError(
            "two-round settings: use core.sparse_lda.selection_release (round 2 is the moments "
            "release of settings.selected_round())"
        )


def statistics_vector(party: PartyData, settings: PrivacySettings) -> np.ndarray:
    """One party's exact statistics ``w S1 | w S0 | w n1 | w n0 | P(sum x x^T)``, rows
    clipped to ``row_clip_norm``, on the grid. Noise is added by the caller's share."""
    _check_row_unit(settings)
    rows = clip_rows(party.features, settings.row_clip_norm)
    weight = settings.mean_weight
    positive = party.labels == POSITIVE_LABEL
    negative = party.labels == NEGATIVE_LABEL
    vector = np.concatenate(
        [
            weight * rows[positive].sum(axis=0),
            weight * rows[negative].sum(axis=0),
            weight * np.array([positive.sum(), negative.sum()], dtype=np.float64),
            pack_symmetric(rows.T @ rows),
        ]
    )
    return round_to_grid(vector, settings.grid_granularity)


def statistics_norm_bound(n_rows: int, settings: PrivacySettings, n_features: int) -> float:
    """Largest L2 norm an honest party's exact statistics can have: each of its n rows adds
    at most ``R w`` to the sums, ``w`` to the counts and ``R^2`` to the moment matrix."""
    radius, weight = settings.row_clip_norm, settings.mean_weight
    rounding = settings.grid_granularity * math.sqrt(release_dimension(settings, n_features))
    return n_rows * math.sqrt((radius * weight) ** 2 + weight**2 + radius**4) + rounding


def _pooled_count(released: float, label: int, noise_std: float) -> float:
    """A class's released row count over all parties, refused below two rows."""
    if released < MIN_ROWS_PER_CLASS:
        noise = f" (its noise has std {noise_std:.2g})" if noise_std > 0 else ""
        raise MissingClassError(
            f"the parties' summed statistics hold {float(released):.1f} rows with label "
            f"{label}{noise}; the pooled fit needs at least {MIN_ROWS_PER_CLASS} rows of each "
            "class over all parties to estimate the class means"
        )
    return float(released)


def model_from_statistics(
    total: np.ndarray,
    n_features: int,
    total_rows: int,
    sum_noise_std: float,
    settings: PrivacySettings,
    fit: LocalFitSettings | None = None,
    *,
    noise_ridge_scale: float = NOISE_RIDGE_SCALE,
    sparse: bool = True,
) -> LinearDiscriminant:
    """Coordinator: pooled class means and covariance from the (noisy) summed statistics,
    then the paper's L1 direction on them (``lambda = scale sqrt(log d / N)``), or with
    ``sparse=False`` the plain LDA direction ``(Sigma + ridge I)^-1 mu_d``.

    Post-processing only: the class counts are averaged with the public row count (``n0 = N -
    n1``), the ridge ``noise_ridge_scale * ||E||`` uses the public noise level and the
    covariance is projected onto the positive semidefinite cone. A class whose released
    count is below two rows over all parties is refused (``MissingClassError``): its mean would
    be noise. Sites each holding one class are fine; only the pooled counts matter here.
    """
    _check_row_unit(settings)
    d = n_features
    if total.shape != (release_dimension(settings, d),):
        raise ShapeError(f"summed statistics have shape {total.shape}, expected d = {d}")
    weight = settings.mean_weight
    sums_positive, sums_negative = total[:d] / weight, total[d : 2 * d] / weight
    # The row count is exact and public, so n0 = N - n1: the two released counts are two
    # readings of n1 with equal noise, and their average has half the noise variance.
    positive = (total[2 * d] / weight + total_rows - total[2 * d + 1] / weight) / 2.0
    count_noise = sum_noise_std / weight / math.sqrt(2.0)
    count_positive = _pooled_count(positive, POSITIVE_LABEL, count_noise)
    count_negative = _pooled_count(total_rows - positive, NEGATIVE_LABEL, count_noise)
    second = unpack_symmetric(total[2 * d + 2 :], d)
    mean_positive = sums_positive / count_positive
    mean_negative = sums_negative / count_negative
    covariance = (
        second
        - count_positive * np.outer(mean_positive, mean_positive)
        - count_negative * np.outer(mean_negative, mean_negative)
    ) / total_rows
    eigenvalues, vectors = np.linalg.eigh((covariance + covariance.T) / 2.0)
    noise_norm = math.sqrt(2.0 * d) * sum_noise_std / total_rows
    ridge = noise_ridge_scale * noise_norm
    covariance = (vectors * np.maximum(eigenvalues, 0.0)) @ vectors.T + ridge * np.eye(d)
    target = mean_positive - mean_negative
    if not sparse:
        try:
            direction = np.linalg.solve(covariance, target)
        except np.linalg.LinAlgError:  # singular and no noise ridge: the LP's fallback ridge
            extra = DIRECTION_RIDGE_FRACTION * max(typical_variance(np.diag(covariance)), 1e-12)
            direction = np.linalg.solve(covariance + extra * np.eye(d), target)
        return LinearDiscriminant(direction, mean_positive, mean_negative)
    scale = (fit or LocalFitSettings()).direction_radius_scale
    radius = scaled_radius(scale, max(d, 2), total_rows)
    try:
        direction = solve_l1_dantzig(covariance, target, radius)
    except InfeasibleProgramError:  # a column constant everywhere and no noise: ridge it
        extra = DIRECTION_RIDGE_FRACTION * max(typical_variance(np.diag(covariance)), 1e-12)
        direction = solve_l1_dantzig(covariance + extra * np.eye(d), target, radius)
    return LinearDiscriminant(direction, mean_positive, mean_negative)
