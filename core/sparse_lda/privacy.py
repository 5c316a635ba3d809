"""Gaussian noise added *after* aggregation, in shares, so no one sees the noiseless sum.

This module is the ONE place where the noise is calibrated (:func:`calibrate`): the flow's
tasks and the single-process methods both call it, with the number of honest shares each
sizes the noise for. Two units of protection are offered (:class:`PrivacyUnit`):

* ``row`` (default in the flow): each party releases its clipped sufficient statistics
  (:mod:`core.sparse_lda.moments_release`); the guarantee protects one row (one patient) of
  one party, and the noise on the fitted model falls like 1 / (total rows).
* ``party``: each party releases its clipped debiased direction and means (below); the
  guarantee protects everything one party holds, so the noise does not fall with rows.

The row unit has two mechanisms (:class:`RowMechanism`): ``moments``, one round (above), and
``selected_moments``, two rounds (:mod:`core.sparse_lda.selection_release`: noisy
per-feature statistics select k features, then only their moments are released). The two
rounds share one sigma, calibrated here for their combined sensitivity, so together they
spend the one (epsilon, delta) the ledger charges.

Party-level mechanism. Each party sends ``round_g(clip(beta_tilde)) | round_g(clip(mu1)) |
round_g(clip(mu2))`` plus its own noise share, an exact discrete Gaussian on the grid
``g * Z`` with variance ``sigma^2 / (m - c)``. The secure sum adds the m contributions, so
the released sum carries noise of variance ``m sigma^2 / (m - c)`` and only the noisy sum is
ever decoded; dividing by m is post-processing.

Party-level sensitivity (honest version). The map from a party's rows to beta_tilde is an LP
solution plus a lasso-based correction; it has no useful Lipschitz bound in one row (the L1
program's solution can jump when a row moves Sigma_hat slightly). So we bound what a party
can move at all: each block is clipped to an L2 ball (radius C_beta for the direction, C_mu
for each mean) and rounded to the grid, hence changing *anything* in one party, in
particular one row, moves the sum by at most ``Delta = 2 sqrt(C_beta^2 + 2 C_mu^2) + g
sqrt(3 d)`` (the last term covers grid rounding). The guarantee is therefore party-level
(eps, delta)-DP, which implies row-level DP with the same parameters; clipping radii below
the true norms bias the released model, which is the price of this bound. Row counts are
treated as public.

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
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from core.dp.discrete_privacy import zcdp_sigma
from core.dp.samplers import gaussian_on_grid
from core.option_defaults import PrivacyUnit
from core.sparse_lda.errors import ContributionError, PrivacySettingsError

DEFAULT_GRID_GRANULARITY = 2.0**-24
"""Same resolution as the secure sum's default fixed-point encoding, so encoding adds no
further rounding to already-gridded contributions."""

BLOCKS_PER_CONTRIBUTION = 3
"""direction, mean of class 1, mean of class 2 (party-level release)."""

DEFAULT_SELECTION_BUDGET_SHARE = 0.3
"""Two-round row release: share of rho spent on the selection round. On the demo hospitals
0.15 and 0.3 were within noise of each other."""

SELECTION_MEAN_SHARE = 0.7
"""Within the selection round, share of its rho on the class sums and counts (the rest on
the per-feature squares, which only scale the selection scores)."""

DEFAULT_MEAN_BUDGET_SHARE = 0.4
"""Row-level release: share of the privacy budget (of rho, in zCDP terms) spent on the class
sums and counts; the rest goes to the second-moment matrix. Tuned once on the paper's
synthetic design (m = 20, eps = 10); 0.15 to 0.5 were within noise of each other."""

NOISELESS_COORDINATE_BOUND = 1e6
"""Noise-free modes have no clipping, so a contribution must still look like an estimate:
no coordinate above 1e6 (LDA weights on standardised features are O(1) to O(100); the
blow-ups this guards against reach 1e14). Far inside the secure sum's fixed-point range."""


class RowMechanism(StrEnum):
    """How the row-level release spends its budget.

    * ``moments``: one round, the class sums, counts and all ``d (d + 1) / 2`` second moments.
    * ``selected_moments``: two rounds under one (epsilon, delta): per-feature class sums,
      counts and squares of all d features, from which the coordinator selects the
      ``selected_features`` best-separating ones (post-processing), then the moments of
      those k features only (:mod:`core.sparse_lda.selection_release`).
    """

    MOMENTS = "moments"
    SELECTED_MOMENTS = "selected_moments"


@dataclass(frozen=True)
class PrivacySettings:
    """(epsilon, delta) for the whole release, the unit it protects and its clipping radii.

    Party unit: ``direction_clip_norm`` and ``mean_clip_norm`` bound what one party sends.
    Row unit: ``row_clip_norm`` bounds each row's L2 norm before its statistics are summed.
    """

    epsilon: float
    delta: float
    direction_clip_norm: float | None = None
    mean_clip_norm: float | None = None
    colluding_parties: int = 0
    grid_granularity: float = DEFAULT_GRID_GRANULARITY
    noise_disabled_for_testing: bool = False
    """Test-only: send exact, unclipped vectors and add no noise. Never use in a deployment."""
    unit: PrivacyUnit = PrivacyUnit.PARTY
    row_clip_norm: float | None = None
    mean_budget_share: float = DEFAULT_MEAN_BUDGET_SHARE
    row_mechanism: RowMechanism = RowMechanism.MOMENTS
    selected_features: int | None = None
    """``selected_moments``: how many features the selection round keeps (k)."""
    selected_clip_norm: float | None = None
    """``selected_moments``: row clip radius in the k selected features (default: R)."""
    selection_budget_share: float = DEFAULT_SELECTION_BUDGET_SHARE

    def __post_init__(self) -> None:
        if not self.epsilon > 0 or not math.isfinite(self.epsilon):
            raise PrivacySettingsError(f"epsilon must be finite and > 0, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise PrivacySettingsError(f"delta must be in (0, 1), got {self.delta}")
        try:
            object.__setattr__(self, "unit", PrivacyUnit(self.unit))
        except ValueError:
            raise PrivacySettingsError(
                f"privacy unit must be 'row' or 'party', got {self.unit!r}"
            ) from None
        needed = ["grid_granularity"]
        needed += (
            ["row_clip_norm"]
            if self.unit is PrivacyUnit.ROW
            else ["direction_clip_norm", "mean_clip_norm"]
        )
        for name in needed:
            value = getattr(self, name)
            if value is None or not value > 0 or not math.isfinite(value):
                raise PrivacySettingsError(
                    f"{name} must be finite and > 0 for the {self.unit.value}-level release, "
                    f"got {value}"
                )
        if self.unit is PrivacyUnit.ROW and self.row_clip_norm < 1.0:
            raise PrivacySettingsError(
                f"row_clip_norm must be >= 1 (rows are clipped to an L2 ball of that radius; "
                f"standardised rows have norm about sqrt(d)), got {self.row_clip_norm}"
            )
        try:
            object.__setattr__(self, "row_mechanism", RowMechanism(self.row_mechanism))
        except ValueError:
            choices = ", ".join(m.value for m in RowMechanism)
            raise PrivacySettingsError(
                f"row_mechanism must be one of {choices}, got {self.row_mechanism!r}"
            ) from None
        if self.two_rounds:
            self._check_selection()
        if not 0 < self.mean_budget_share < 1:
            raise PrivacySettingsError(
                f"mean_budget_share must be in (0, 1), got {self.mean_budget_share}"
            )
        if self.colluding_parties < 0:
            raise PrivacySettingsError(
                f"colluding_parties must be >= 0, got {self.colluding_parties}"
            )

    @classmethod
    def noiseless_for_testing(cls) -> PrivacySettings:
        """Settings that switch the whole mechanism off, for tests of the plain average."""
        return cls(1.0, 1e-6, 1.0, 1.0, noise_disabled_for_testing=True)

    @classmethod
    def row_level(
        cls, epsilon: float, delta: float, row_clip_norm: float, **options: object
    ) -> PrivacySettings:
        """Row-level settings: each row is clipped to ``row_clip_norm``."""
        return cls(epsilon, delta, unit=PrivacyUnit.ROW, row_clip_norm=row_clip_norm, **options)

    @property
    def mean_weight(self) -> float:
        """Row unit: factor on the class sums and counts that gives them ``mean_budget_share``.

        Each block on its own moves by at most ``sqrt(2) R^2`` (second moments) and ``2 R w``
        (weighted sums); equal noise on both spends rho in the ratio of their squares, so
        ``4 R^2 w^2 = share / (1 - share) * 2 R^4``. The share is nominal: no single row
        reaches both maxima at once, and :func:`row_sensitivity` bounds the pair jointly.
        """
        radius = self._row_radius()
        share = self.mean_budget_share
        return radius * math.sqrt(share / (2.0 * (1.0 - share)))

    def _row_radius(self) -> float:
        if self.row_clip_norm is None:
            raise PrivacySettingsError("row_clip_norm is needed for the row-level release")
        return float(self.row_clip_norm)

    @property
    def two_rounds(self) -> bool:
        """Row unit with a selection round before the (selected) moments round."""
        return self.unit is PrivacyUnit.ROW and self.row_mechanism is RowMechanism.SELECTED_MOMENTS

    def _check_selection(self) -> None:
        k = self.selected_features
        if k is None or isinstance(k, bool) or int(k) != k or k < 1:
            raise PrivacySettingsError(
                f"selected_features must be an integer >= 1 for row_mechanism "
                f"'selected_moments', got {k!r}"
            )
        radius = self.selected_clip_norm
        if radius is not None and (not math.isfinite(radius) or radius < 1.0):
            raise PrivacySettingsError(
                f"selected_clip_norm must be finite and >= 1 (see row_clip_norm), got {radius}"
            )
        if not 0 < self.selection_budget_share < 1:
            raise PrivacySettingsError(
                f"selection_budget_share must be in (0, 1), got {self.selection_budget_share}"
            )

    def selected_round(self) -> PrivacySettings:
        """Settings of the second round: the one-round moments release on the k selected
        features, rows clipped to ``selected_clip_norm``. Its vector and its fit are the
        ``moments`` ones; its noise is this two-round calibration's (:func:`calibrate`)."""
        radius = self.selected_clip_norm or self._row_radius()
        return replace(
            self,
            row_clip_norm=radius,
            row_mechanism=RowMechanism.MOMENTS,
            selected_features=None,
            selected_clip_norm=None,
        )

    def selection_weights(self) -> tuple[float, float]:
        """Selection round: factors on (class sums and counts, per-feature squares).

        One sigma serves both rounds; the weights give the selection round the share
        ``selection_budget_share`` of the total squared sensitivity (hence of rho), split
        ``SELECTION_MEAN_SHARE`` to the sums and counts. With rows clipped to R the sums and
        counts move by at most ``2 R a`` and the squares by ``sqrt(2) R^2 b``
        (:func:`selection_sensitivity`), so ``4 R^2 a^2 = s q Delta_2^2 / (1 - s)`` and
        ``2 R^4 b^2 = s (1 - q) Delta_2^2 / (1 - s)``, Delta_2 the second round's sensitivity.
        """
        radius = self._row_radius()
        second = self.selected_round()
        rest = row_sensitivity(second._row_radius(), second.mean_weight) ** 2
        share = self.selection_budget_share
        selection = share / (1.0 - share) * rest
        sums = math.sqrt(SELECTION_MEAN_SHARE * selection) / (2.0 * radius)
        squares = math.sqrt((1.0 - SELECTION_MEAN_SHARE) * selection / 2.0) / radius**2
        return sums, squares


def check_party_count(settings: PrivacySettings, n_parties: int) -> None:
    """Noise shares need at least one party outside the tolerated colluders."""
    if settings.colluding_parties >= n_parties:
        raise PrivacySettingsError(
            f"colluding_parties = {settings.colluding_parties} leaves no honest party among "
            f"{n_parties}; it must be at most {n_parties - 1}"
        )


def release_dimension(settings: PrivacySettings, n_features: int) -> int:
    """Length of one party's vector for the (last) secure sum.

    Two-round row release: the second round's, on the k selected features; the first
    round's is :func:`selection_dimension`.
    """
    if settings.two_rounds:
        return release_dimension(settings.selected_round(), settings.selected_features)
    if settings.unit is PrivacyUnit.ROW:
        return 2 * n_features + 2 + n_features * (n_features + 1) // 2
    return BLOCKS_PER_CONTRIBUTION * n_features


def selection_dimension(n_features: int) -> int:
    """Selection round: ``a S1 | a S0 | a n1 | a n0 | b sum x_j^2`` (3 d + 2 entries)."""
    return 3 * n_features + 2


def selection_sensitivity(radius: float, sums_weight: float, squares_weight: float) -> float:
    """How far one party's selection-round vector moves when one of its rows is replaced.

    Rows clipped to ``||x|| <= R``. Sums and counts: as in :func:`row_sensitivity`, at most
    ``2 R a`` (same label: ``||x' - x|| <= 2R``; label flip: ``a sqrt(2 R^2 + 2) <= 2 R a`` as
    R >= 1). Per-feature squares ``q = sum x (.) x``: ``||x (.) x - x' (.) x'||^2 =
    sum_j (x_j^2 - x'_j^2)^2 <= sum_j x_j^4 + x'_j^4 <= ||x||^4 + ||x'||^4 <= 2 R^4`` (the
    cross terms are >= 0). Hence ``sqrt(4 R^2 a^2 + 2 R^4 b^2)``.
    """
    return math.sqrt(4.0 * radius**2 * sums_weight**2 + 2.0 * radius**4 * squares_weight**2)


def row_sensitivity(radius: float, mean_weight: float) -> float:
    """How far one party's row-level statistics move when one of its rows is replaced.

    The party sends ``w S1 | w S0 | w n1 | w n0 | P(M)`` with every row clipped to
    ``||x|| <= R``: ``S_k`` the sum of class-k rows, ``n_k`` their count, ``M = sum x x^T``
    and ``P`` the packing of the upper triangle with off-diagonal entries times sqrt(2), so
    ``||P(A)||_2 = ||A||_F``. Replace row ``(x, y)`` by ``(x', y')``, with ``a = ||x||``,
    ``b = ||x'||`` (both <= R) and ``c`` the cosine of their angle:

    * ``M`` moves by ``||x x^T - x' x'^T||_F^2 = a^4 + b^4 - 2 a^2 b^2 c^2``.
    * Same label: ``S_y`` moves by ``x' - x``, counts do not move. The two blocks pull ``c``
      opposite ways (``x' = -x`` moves the sum most and ``M`` not at all), so bound them
      together: ``w^2 (a^2 + b^2) + a^4 + b^4 + g(c)`` with ``g(c) = -2 a b w^2 c -
      2 a^2 b^2 c^2``, a concave parabola whose top is ``w^4 / 2`` at ``c = -w^2 / (2 a b)``.
      If ``w^2 <= 2 R^2`` that angle exists at ``a = b = R``: ``2 R^4 + 2 R^2 w^2 + w^4 / 2``.
      Otherwise ``c = -1`` is best and the total is ``(a + b)^2 (w^2 + (a - b)^2) <=
      4 R^2 w^2``: while ``a + b <= R`` it is at most ``R^2 (w^2 + R^2)``, and beyond, with
      ``|a - b| <= 2R - (a + b)``, it grows with ``a + b`` since ``w^2 > R^2 / 2``.
    * Label flips: ``S_y`` loses x, ``S_y'`` gains x' and each count moves by 1:
      ``w^2 (a^2 + b^2 + 2) + a^4 + b^4 - 2 a^2 b^2 c^2 <= 2 R^4 + 2 R^2 w^2 + 2 w^2``
      (orthogonal rows on the sphere).

    ``Delta`` is the square root of the larger case. Each case is reached by a pair of rows
    (the tests build them), so the bound is exact; bounding the blocks separately, ``2 R^4 +
    4 R^2 w^2``, costs about 10% more noise at the default budget share. It holds for any
    row contents, any labels and any party: the sum's sensitivity (other parties'
    statistics do not move). The total row count n is not in the vector; replacing (not
    adding) a row keeps it fixed, and it is treated as public like the parties' names.
    """
    r2, w2 = radius * radius, mean_weight * mean_weight
    joint = 2.0 * r2 * r2 + 2.0 * r2 * w2 + w2 * w2 / 2.0  # the angle c = -w^2 / (2 R^2)
    same_label = joint if w2 <= 2.0 * r2 else 4.0 * r2 * w2  # else opposite rows
    label_flip = 2.0 * r2 * r2 + 2.0 * r2 * w2 + 2.0 * w2
    return math.sqrt(max(same_label, label_flip))


def sum_sensitivity(settings: PrivacySettings, n_features: int) -> float:
    """L2 distance the summed contributions can move between neighbouring inputs.

    Party unit: any change to one party's data, after clipping (module docstring).
    Row unit: one row of one party replaced by any other row, label included
    (:func:`row_sensitivity`). Both add ``g sqrt(dimension)`` for rounding each
    contribution to the grid (two roundings of at most ``g/2`` per coordinate).

    Two-round row unit: both rounds are answered with one sigma, so the pair is one Gaussian
    mechanism of sensitivity ``sqrt(Delta_1^2 + Delta_2^2)`` (zCDP composes additively, and
    adaptively: the second round's features depend on the first round's output, but its
    bound does not), plus rounding over both vectors.
    """
    if settings.two_rounds:
        second = settings.selected_round()
        k = settings.selected_features
        dims = selection_dimension(n_features) + release_dimension(second, k)
        first = selection_sensitivity(settings._row_radius(), *settings.selection_weights())
        last = row_sensitivity(second._row_radius(), second.mean_weight)
        return math.hypot(first, last) + settings.grid_granularity * math.sqrt(dims)
    rounding = settings.grid_granularity * math.sqrt(release_dimension(settings, n_features))
    if settings.unit is PrivacyUnit.ROW:
        return row_sensitivity(settings._row_radius(), settings.mean_weight) + rounding
    clipped = math.hypot(settings.direction_clip_norm, math.sqrt(2) * settings.mean_clip_norm)
    return 2.0 * clipped + rounding


@dataclass(frozen=True)
class NoiseCalibration:
    """Public noise parameters of one release (they depend only on settings, d and shares)."""

    sensitivity: float
    sigma: float
    """Std per coordinate that every unmaskable sum carries at least."""
    share_sigma: float
    """Std of one party's share: ``sigma / sqrt(honest_shares)``."""
    honest_shares: int
    """Shares every released sum holds that no tolerated colluder knows."""
    granularity: float

    def sum_std(self, contributors: int) -> float:
        """Per-coordinate noise std of a sum of ``contributors`` noisy vectors."""
        return self.share_sigma * math.sqrt(contributors)

    def average_std(self, contributors: int) -> float:
        """Per-coordinate noise std of the average over ``contributors`` noisy vectors."""
        return self.sum_std(contributors) / contributors


def calibrate(settings: PrivacySettings, n_features: int, honest_shares: int) -> NoiseCalibration:
    """sigma for (epsilon, delta), split into shares: the only calibration in the project's
    sparse LDA. ``honest_shares`` is ``m - c`` in a single-process fit and ``t - c`` in the
    flow (t the secure-sum threshold: the coordinator never unmasks fewer than t senders).

    The noise is a sum of discrete Gaussians, so sigma comes from the proven discrete-Gaussian
    bound (zCDP, Canonne-Kamath-Steinke 2020), not the continuous analytic calibration, which
    at the same sigma can exceed delta slightly for discrete noise.
    """
    if honest_shares < 1:
        raise PrivacySettingsError(f"need at least one honest noise share, got {honest_shares}")
    sensitivity = sum_sensitivity(settings, n_features)
    sigma = zcdp_sigma(settings.epsilon, settings.delta, sensitivity)
    return NoiseCalibration(
        sensitivity,
        sigma,
        sigma / math.sqrt(honest_shares),
        honest_shares,
        settings.grid_granularity,
    )


def party_calibration(
    settings: PrivacySettings, n_features: int, n_parties: int
) -> NoiseCalibration:
    """Calibration of a single-process fit: every one of the m parties sends, c0 collude."""
    check_party_count(settings, n_parties)
    return calibrate(settings, n_features, n_parties - settings.colluding_parties)


def sum_noise_std(settings: PrivacySettings, n_features: int) -> float:
    """sigma of the noise on the sum, calibrated for (epsilon, delta)."""
    return calibrate(settings, n_features, 1).sigma


def noise_share_std(settings: PrivacySettings, n_features: int, n_parties: int) -> float:
    """Std of one party's share: ``sigma / sqrt(m - c0)``, so m - c0 shares give sigma."""
    return party_calibration(settings, n_features, n_parties).share_sigma


def average_noise_std(settings: PrivacySettings, n_features: int, n_parties: int) -> float:
    """Per-coordinate noise std of the released *average* (all m shares, divided by m)."""
    if settings.noise_disabled_for_testing:
        return 0.0
    return party_calibration(settings, n_features, n_parties).average_std(n_parties)


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


def check_contribution(party: str, vector: np.ndarray, norm_bound: float | None) -> np.ndarray:
    """Refuse a vector that is not finite, or longer than ``norm_bound`` (None: the
    noise-free coordinate bound), naming the party, before it can enter any sum."""
    values = np.asarray(vector, dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise ContributionError(
            f"party {party!r}: contribution coordinate {int(bad[0])} is {float(values[bad[0]])}; "
            "refused, it is not averaged in"
        )
    if norm_bound is None:
        worst = int(np.argmax(np.abs(values))) if values.size else 0
        if values.size and abs(values[worst]) > NOISELESS_COORDINATE_BOUND:
            raise ContributionError(
                f"party {party!r}: contribution coordinate {worst} is {values[worst]:.3g}, "
                f"beyond the bound {NOISELESS_COORDINATE_BOUND:g}; refused, not averaged in"
            )
        return values
    norm = float(np.linalg.norm(values))
    if norm > norm_bound:
        raise ContributionError(
            f"party {party!r}: contribution has L2 norm {norm:.6g} > its bound "
            f"{norm_bound:.6g}; refused, not averaged in"
        )
    return values


def party_level_blocks(
    direction: np.ndarray,
    mean_positive: np.ndarray,
    mean_negative: np.ndarray,
    settings: PrivacySettings,
) -> np.ndarray:
    """Party unit, before noise: clipped blocks on the grid (exact, unclipped when noiseless)."""
    if settings.noise_disabled_for_testing:
        return np.concatenate([direction, mean_positive, mean_negative])
    blocks = [
        clip_to_norm(direction, settings.direction_clip_norm),
        clip_to_norm(mean_positive, settings.mean_clip_norm),
        clip_to_norm(mean_negative, settings.mean_clip_norm),
    ]
    return round_to_grid(np.concatenate(blocks), settings.grid_granularity)


def add_noise_share(exact: np.ndarray, calibration: NoiseCalibration) -> np.ndarray:
    """One party's noise share: exact discrete Gaussian on the grid (CSPRNG)."""
    return exact + gaussian_on_grid(calibration.share_sigma, calibration.granularity, exact.size)


def private_contribution(
    direction: np.ndarray,
    mean_positive: np.ndarray,
    mean_negative: np.ndarray,
    settings: PrivacySettings,
    n_parties: int,
) -> np.ndarray:
    """Party unit, single process: clipped, gridded blocks plus the party's noise share."""
    exact = party_level_blocks(direction, mean_positive, mean_negative, settings)
    if settings.noise_disabled_for_testing:
        return exact
    return add_noise_share(exact, party_calibration(settings, direction.shape[0], n_parties))
