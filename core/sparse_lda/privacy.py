"""Gaussian noise added *after* aggregation, in shares, so no one sees the noiseless average.

Mechanism. Each party sends ``round_g(clip(beta_tilde)) | round_g(clip(mu1)) |
round_g(clip(mu2))`` plus its own noise share, an exact discrete Gaussian on the grid
``g * Z`` with variance ``sigma^2 / (m - c)``. The secure sum adds the m contributions, so
the released sum carries noise of variance ``m sigma^2 / (m - c)`` and only the noisy sum is
ever decoded; dividing by m is post-processing.

Sensitivity (honest version). The map from a party's rows to beta_tilde is an LP solution plus
a lasso-based correction; it has no useful Lipschitz bound in one row (the L1 program's
solution can jump when a row moves Sigma_hat slightly). So we bound what a party can move
at all: each block is clipped to an L2 ball (radius C_beta for the direction, C_mu for each
mean) and rounded to the grid, hence changing *anything* in one party, in particular one row,
moves the sum by at most ``Delta = 2 sqrt(C_beta^2 + 2 C_mu^2) + g sqrt(3 d)`` (the last
term covers grid rounding). The guarantee is therefore party-level (eps, delta)-DP, which
implies row-level DP with the same parameters; clipping radii below the true norms bias the
released model, which is the price of this bound. Row counts are treated as public.

Collusion. Parties that collude know their own shares and can subtract them. If c
parties other than the victim collude, the remaining noise variance is ``(m - c) / (m - c0)``
times ``sigma^2`` where c0 = ``colluding_parties`` is the number the shares were sized for;
with c <= c0 the full calibrated sigma remains, with c0 = 0 only ``sigma sqrt((m - c)/m)``.

Exactness. Noise comes from an exact discrete Gaussian sampler on the grid (no floating-point
leakage, Mironov 2012) and contributions are rounded to the same grid, so the low-order bits
of the sum carry no data. A sum of independent discrete Gaussians is not exactly a discrete
Gaussian, but with sigma / g around 10^5 or more the gap is negligible (Canonne, Kamath &
Steinke 2020); sigma itself is calibrated with their proven zCDP bound for the discrete
Gaussian (``core.dp.discrete_privacy.zcdp_sigma``), about 8% above the continuous analytic
calibration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from core.dp.discrete_privacy import zcdp_sigma
from core.dp.samplers import gaussian_on_grid
from core.sparse_lda.errors import PrivacySettingsError

DEFAULT_GRID_GRANULARITY = 2.0**-24
"""Same resolution as the secure sum's default fixed-point encoding, so encoding adds no
further rounding to already-gridded contributions."""

BLOCKS_PER_CONTRIBUTION = 3
"""direction, mean of class 1, mean of class 2."""


@dataclass(frozen=True)
class PrivacySettings:
    """(epsilon, delta) for the whole release, the clipping radii and the collusion margin."""

    epsilon: float
    delta: float
    direction_clip_norm: float
    mean_clip_norm: float
    colluding_parties: int = 0
    grid_granularity: float = DEFAULT_GRID_GRANULARITY
    noise_disabled_for_testing: bool = False
    """Test-only: send exact, unclipped vectors and add no noise. Never use in a deployment."""

    def __post_init__(self) -> None:
        if not self.epsilon > 0 or not math.isfinite(self.epsilon):
            raise PrivacySettingsError(f"epsilon must be finite and > 0, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise PrivacySettingsError(f"delta must be in (0, 1), got {self.delta}")
        for name in ("direction_clip_norm", "mean_clip_norm", "grid_granularity"):
            value = getattr(self, name)
            if not value > 0 or not math.isfinite(value):
                raise PrivacySettingsError(f"{name} must be finite and > 0, got {value}")
        if self.colluding_parties < 0:
            raise PrivacySettingsError(
                f"colluding_parties must be >= 0, got {self.colluding_parties}"
            )

    @classmethod
    def noiseless_for_testing(cls) -> PrivacySettings:
        """Settings that switch the whole mechanism off, for tests of the plain average."""
        return cls(1.0, 1e-6, 1.0, 1.0, noise_disabled_for_testing=True)


def check_party_count(settings: PrivacySettings, n_parties: int) -> None:
    """Noise shares need at least one party outside the tolerated colluders."""
    if settings.colluding_parties >= n_parties:
        raise PrivacySettingsError(
            f"colluding_parties = {settings.colluding_parties} leaves no honest party among "
            f"{n_parties}; it must be at most {n_parties - 1}"
        )


def sum_sensitivity(settings: PrivacySettings, n_features: int) -> float:
    """L2 distance the summed contributions can move when one party's data change."""
    clipped = math.hypot(settings.direction_clip_norm, math.sqrt(2) * settings.mean_clip_norm)
    rounding = settings.grid_granularity * math.sqrt(BLOCKS_PER_CONTRIBUTION * n_features)
    return 2.0 * clipped + rounding


def sum_noise_std(settings: PrivacySettings, n_features: int) -> float:
    """sigma of the noise on the sum, calibrated for (epsilon, delta).

    The noise is a sum of discrete Gaussians, so it uses the proven discrete-Gaussian bound
    (zCDP, Canonne-Kamath-Steinke 2020), not the continuous analytic calibration, which at
    the same sigma can exceed delta slightly for discrete noise.
    """
    return zcdp_sigma(settings.epsilon, settings.delta, sum_sensitivity(settings, n_features))


def noise_share_std(settings: PrivacySettings, n_features: int, n_parties: int) -> float:
    """Std of one party's share: ``sigma / sqrt(m - c0)``, so m - c0 shares give sigma."""
    check_party_count(settings, n_parties)
    honest = n_parties - settings.colluding_parties
    return sum_noise_std(settings, n_features) / math.sqrt(honest)


def average_noise_std(settings: PrivacySettings, n_features: int, n_parties: int) -> float:
    """Per-coordinate noise std of the released *average* (all m shares, divided by m)."""
    if settings.noise_disabled_for_testing:
        return 0.0
    return noise_share_std(settings, n_features, n_parties) * math.sqrt(n_parties) / n_parties


def noise_left_after_collusion(
    settings: PrivacySettings, n_features: int, n_parties: int, colluders: int
) -> float:
    """Noise std on the sum that ``colluders`` parties cannot remove by subtracting their shares."""
    if not 0 <= colluders < n_parties:
        raise PrivacySettingsError(f"colluders must be in [0, {n_parties - 1}], got {colluders}")
    share = noise_share_std(settings, n_features, n_parties)
    return share * math.sqrt(n_parties - colluders)


def clip_to_norm(vector: np.ndarray, bound: float) -> np.ndarray:
    """Scale ``vector`` down onto the L2 ball of radius ``bound`` if it lies outside."""
    norm = float(np.linalg.norm(vector))
    return vector if norm <= bound else vector * (bound / norm)


def round_to_grid(vector: np.ndarray, granularity: float) -> np.ndarray:
    """Nearest multiple of ``granularity``, so data and noise share one grid."""
    return np.rint(vector / granularity) * granularity


def private_contribution(
    direction: np.ndarray,
    mean_positive: np.ndarray,
    mean_negative: np.ndarray,
    settings: PrivacySettings,
    n_parties: int,
) -> np.ndarray:
    """One party's input to the secure sum: clipped, gridded blocks plus its noise share."""
    if settings.noise_disabled_for_testing:
        return np.concatenate([direction, mean_positive, mean_negative])
    blocks = [
        clip_to_norm(direction, settings.direction_clip_norm),
        clip_to_norm(mean_positive, settings.mean_clip_norm),
        clip_to_norm(mean_negative, settings.mean_clip_norm),
    ]
    exact = round_to_grid(np.concatenate(blocks), settings.grid_granularity)
    n_features = direction.shape[0]
    share_std = noise_share_std(settings, n_features, n_parties)
    return exact + gaussian_on_grid(share_std, settings.grid_granularity, exact.shape[0])
