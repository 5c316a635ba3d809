"""What one party computes on its own rows: the sparse LDA direction and its debiased version."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.sparse_lda.dantzig import (
    DEFAULT_DIRECTION_RADIUS_SCALE,
    scaled_radius,
    solve_l1_dantzig,
)
from core.sparse_lda.errors import SparseLDAInputError
from core.sparse_lda.moments import ClassMoments, class_moments
from core.sparse_lda.party_data import PartyData
from core.sparse_lda.precision import (
    PrecisionMethod,
    clime_precision,
    nodewise_lasso_precision,
)

DEFAULT_NODEWISE_PENALTY_SCALE = 0.3
DEFAULT_CLIME_RADIUS_SCALE = 0.5


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


def sparse_direction(moments: ClassMoments, radius: float) -> np.ndarray:
    """beta_hat = argmin ||b||_1 s.t. ||Sigma_hat b - (mu1_hat - mu2_hat)||_inf <= radius."""
    return solve_l1_dantzig(moments.covariance, moments.mean_difference, radius)


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
    return nodewise_lasso_precision(moments.centered_rows, penalty)


def fit_local(party: PartyData, settings: LocalFitSettings, *, debiased: bool) -> LocalEstimate:
    """Fit the sparse direction on one party's rows, debiasing it when ``debiased`` is set."""
    moments = class_moments(party.features, party.labels)
    _check_positive_variance(party, moments)
    radius = scaled_radius(settings.direction_radius_scale, party.n_features, party.n_rows)
    beta_hat = sparse_direction(moments, radius)
    beta_tilde = None
    if debiased:
        precision = estimate_precision(moments, settings)
        beta_tilde = debias(beta_hat, moments.covariance, moments.mean_difference, precision)
    return LocalEstimate(
        party=party.name,
        n_rows=party.n_rows,
        sparse_direction=beta_hat,
        debiased_direction=beta_tilde,
        mean_positive=moments.mean_positive,
        mean_negative=moments.mean_negative,
    )


def _check_positive_variance(party: PartyData, moments: ClassMoments) -> None:
    """A column constant within both classes makes Sigma_hat singular in a way no radius fixes."""
    zero_variance = np.flatnonzero(np.diag(moments.covariance) <= 0.0)
    if zero_variance.size:
        column = party.columns[int(zero_variance[0])]
        raise SparseLDAInputError(
            f"party {party.name!r}, column {column!r}: constant within each class (zero "
            "within-class variance); drop the column or add rows"
        )
