"""What one party computes on its own rows: the sparse LDA direction and its debiased version.

Numerical safety at real sites (why the fit looks at its columns first). Sites measure
different things and see different case mixes: a test a site never ran is a column holding
one filled value, a column can be near-constant or nearly a combination of others, one class
can be rare, and there can be more features than rows. Three guards keep every output finite
and bounded, each the smallest change that does so:

* Degenerate columns. A column whose within-class variance is at most
  ``DEGENERATE_RELATIVE_VARIANCE`` times the site's typical (median) within-class variance
  carries no usable information at this site: its coefficient and debiasing correction are
  left at 0, the fit runs on the other columns, and the column is named in
  ``LocalEstimate.degenerate_columns``. A site whose columns are all degenerate is refused
  (``DegenerateDataError`` naming site and column).
* Precision floor. The nodewise-lasso residual variances are floored at
  ``PRECISION_FLOOR_FRACTION`` times the typical variance (``core.sparse_lda.precision``), so
  no correction is amplified by more than ``1 / floor``; with unit variances the paper's
  design (AR(0.8): residual variance 0.22) is untouched.
* Ridge fallback for the LP. With few rows (or p >> n) ``Sigma_hat`` is singular and the
  constraint can be unsatisfiable; the LP is then solved for ``Sigma_hat + ridge I`` (ridge
  ``DIRECTION_RIDGE_FRACTION`` times the typical variance), which is invertible, so a
  feasible point always exists and the direction stays bounded by ``||mu_d|| / ridge``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from core.sparse_lda.dantzig import (
    DEFAULT_DIRECTION_RADIUS_SCALE,
    scaled_radius,
    solve_l1_dantzig,
)
from core.sparse_lda.errors import DegenerateDataError, InfeasibleProgramError, SparseLDAInputError
from core.sparse_lda.moments import (
    ClassMoments,
    centre_within_classes,
    class_moments,
    column_variances,
)
from core.sparse_lda.party_data import PartyData, require_both_classes
from core.sparse_lda.precision import (
    PrecisionMethod,
    clime_precision,
    nodewise_lasso_precision,
)

DEFAULT_NODEWISE_PENALTY_SCALE = 0.3
DEFAULT_CLIME_RADIUS_SCALE = 0.5
DEGENERATE_RELATIVE_VARIANCE = 1e-6
"""Within-class variance at most this fraction of the site's median: no information (a
standard deviation 1e-3 of the typical one is rounding noise around a filled value)."""
PRECISION_FLOOR_FRACTION = 0.05
"""Floor on nodewise residual variances, relative to the typical variance: a correction is
amplified at most 20x (a variance inflation factor of 20, the usual collinearity alarm)."""
DIRECTION_RIDGE_FRACTION = 0.05
"""Ridge added to ``Sigma_hat`` only when the direction LP is infeasible as posed."""


@dataclass(frozen=True)
class LocalFitSettings:
    """Tuning of the local estimators, each as a multiple of ``sqrt(log d / n)``."""

    direction_radius_scale: float = DEFAULT_DIRECTION_RADIUS_SCALE
    precision_method: PrecisionMethod = PrecisionMethod.NODEWISE_LASSO
    nodewise_penalty_scale: float = DEFAULT_NODEWISE_PENALTY_SCALE
    clime_radius_scale: float = DEFAULT_CLIME_RADIUS_SCALE

    def __post_init__(self) -> None:
        for field in ("direction_radius_scale", "nodewise_penalty_scale", "clime_radius_scale"):
            value = getattr(self, field)
            if not value > 0:
                raise SparseLDAInputError(f"LocalFitSettings.{field} must be > 0, got {value}")
        object.__setattr__(self, "precision_method", PrecisionMethod(self.precision_method))


@dataclass(frozen=True)
class LocalEstimate:
    """A party's local results; only these vectors (never rows) leave the party."""

    party: str
    n_rows: int
    sparse_direction: np.ndarray
    """beta_hat: the L1-minimal direction; biased towards zero by the constraint radius."""
    debiased_direction: np.ndarray | None
    """beta_tilde, or None when the fit skipped debiasing (naive-averaging baseline)."""
    mean_positive: np.ndarray
    mean_negative: np.ndarray
    degenerate_columns: tuple[str, ...] = ()
    """Columns constant (to rounding) within classes at this site: coefficient and correction
    are 0 there. Reported so the site's owner and the flow's result can show it."""
    ridge_fallback: bool = False
    """True when the direction LP needed the ridge (singular covariance, e.g. p >> n)."""


def sparse_direction(moments: ClassMoments, radius: float) -> np.ndarray:
    """beta_hat = argmin ||b||_1 s.t. ||Sigma_hat b - (mu1_hat - mu2_hat)||_inf <= radius."""
    return solve_l1_dantzig(moments.covariance, moments.mean_difference, radius)


def typical_variance(variances: np.ndarray) -> float:
    """Median of the positive within-class variances (0 when there are none)."""
    positive = variances[variances > 0]
    return float(np.median(positive)) if positive.size else 0.0


def degenerate_mask(variances: np.ndarray) -> np.ndarray:
    """Columns whose within-class variance is negligible next to the site's typical one."""
    return variances <= DEGENERATE_RELATIVE_VARIANCE * typical_variance(variances)


def _restricted(moments: ClassMoments, keep: np.ndarray) -> ClassMoments:
    return ClassMoments(
        moments.mean_positive[keep],
        moments.mean_negative[keep],
        moments.covariance[np.ix_(keep, keep)],
        moments.centered_rows[:, keep],
    )


def debias(
    direction: np.ndarray,
    covariance: np.ndarray,
    mean_difference: np.ndarray,
    precision: np.ndarray,
) -> np.ndarray:
    """One Newton-type correction removing the L1 shrinkage bias, so averaging cancels noise.

    ``beta_tilde = beta_hat - Theta^T (Sigma_hat beta_hat - mu_d)``.
    """
    return direction - precision.T @ (covariance @ direction - mean_difference)


def estimate_precision(moments: ClassMoments, settings: LocalFitSettings) -> np.ndarray:
    """Dispatch to the configured sparse precision estimator."""
    n_features = moments.covariance.shape[0]
    if settings.precision_method is PrecisionMethod.CLIME:
        radius = scaled_radius(settings.clime_radius_scale, n_features, moments.n_rows)
        return clime_precision(moments.covariance, radius)
    penalty = scaled_radius(settings.nodewise_penalty_scale, n_features, moments.n_rows)
    floor = PRECISION_FLOOR_FRACTION * typical_variance(np.diag(moments.covariance))
    return nodewise_lasso_precision(moments.centered_rows, penalty, floor)


def fit_local(party: PartyData, settings: LocalFitSettings, *, debiased: bool) -> LocalEstimate:
    """Fit the sparse direction on one party's rows, debiasing it when ``debiased`` is set.

    Degenerate columns are left at 0 and reported; the rest is fitted as in the paper.
    """
    require_both_classes(party)
    full = class_moments(party.features, party.labels)
    variances = column_variances(full.centered_rows)  # as degenerate_columns computes them
    degenerate = degenerate_mask(variances)
    if degenerate.all():
        raise DegenerateDataError(
            f"party {party.name!r}: every column is constant within each class (first: column "
            f"{party.columns[0]!r}, within-class variance {variances[0]:.3g}); nothing to fit"
        )
    keep = ~degenerate
    moments = _restricted(full, keep) if degenerate.any() else full
    n_kept = int(keep.sum())
    # log d with d >= 2, so one remaining column still gets a positive radius
    radius = scaled_radius(settings.direction_radius_scale, max(n_kept, 2), party.n_rows)
    ridge_fallback = False
    try:
        beta_kept = sparse_direction(moments, radius)
    except InfeasibleProgramError:
        ridge = DIRECTION_RIDGE_FRACTION * typical_variance(variances)
        ridged = replace(moments, covariance=moments.covariance + ridge * np.eye(n_kept))
        beta_kept, ridge_fallback = sparse_direction(ridged, radius), True
    beta_hat = np.zeros(party.n_features)
    beta_hat[keep] = beta_kept
    beta_tilde = None
    if debiased:
        precision = estimate_precision(moments, settings)
        beta_tilde = np.zeros(party.n_features)
        beta_tilde[keep] = debias(beta_kept, moments.covariance, moments.mean_difference, precision)
    return LocalEstimate(
        party=party.name,
        n_rows=party.n_rows,
        sparse_direction=beta_hat,
        debiased_direction=beta_tilde,
        mean_positive=full.mean_positive,
        mean_negative=full.mean_negative,
        degenerate_columns=_names(party.columns, degenerate),
        ridge_fallback=ridge_fallback,
    )


def _names(columns: tuple[str, ...], mask: np.ndarray) -> tuple[str, ...]:
    return tuple(c for c, flagged in zip(columns, mask, strict=True) if flagged)


def degenerate_columns(party: PartyData) -> tuple[str, ...]:
    """The columns :func:`fit_local` would leave at 0 at this site (cheap: variances only;
    for a site with one class, the columns constant over its rows)."""
    variances = column_variances(centre_within_classes(party.features, party.labels))
    return _names(party.columns, degenerate_mask(variances))
