"""The two-round row-level release: private top-k selection, then the selected moments.

Its noise matches the one calibration, one row moves each round by no more than its bound
(worst-case rows included), and the pair spends exactly one (epsilon, delta)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from neighbouring_rows import neighbouring_parties, party

from core.dp.discrete_privacy import zcdp_delta, zcdp_sigma
from core.sparse_lda import (
    PrivacySettings,
    PrivacySettingsError,
    calibrate,
    fit_selected_moments_release,
    party_calibration,
    row_sensitivity,
    select_features,
    selected_statistics_vector,
    selection_dimension,
    selection_sensitivity,
    selection_vector,
    sum_sensitivity,
)
from core.sparse_lda.privacy import add_noise_share

EPSILON, DELTA = 1.0, 1e-6


def two_rounds(k: int = 2, radius: float = 2.0, selected_radius: float = 1.5) -> PrivacySettings:
    return PrivacySettings.row_level(
        EPSILON,
        DELTA,
        radius,
        row_mechanism="selected_moments",
        selected_features=k,
        selected_clip_norm=selected_radius,
    )


def test_both_rounds_spend_one_epsilon_delta_together() -> None:
    privacy, d = two_rounds(), 5
    second = privacy.selected_round()
    first_bound = selection_sensitivity(2.0, *privacy.selection_weights())
    second_bound = row_sensitivity(1.5, second.mean_weight)
    # round 1 gets its share of rho, round 2 the rest
    share = first_bound**2 / (first_bound**2 + second_bound**2)
    assert share == pytest.approx(privacy.selection_budget_share)
    calibration = calibrate(privacy, d, 1)
    rounding = 2**-24 * math.sqrt(selection_dimension(d) + 2 * 2 + 2 + 3)
    total = math.hypot(first_bound, second_bound) + rounding
    assert calibration.sensitivity == pytest.approx(total)
    assert calibration.sigma == pytest.approx(zcdp_sigma(EPSILON, DELTA, total))
    # zCDP composes: rho_1 + rho_2 at this sigma is one (epsilon, delta) release, charged once
    rho = (first_bound**2 + second_bound**2) / (2 * calibration.sigma**2)
    assert zcdp_delta(EPSILON, rho) <= DELTA
    assert zcdp_delta(EPSILON, rho) > 0.9 * DELTA  # and not a loose overcharge
    # sizing each round alone for the full (epsilon, delta) would spend twice the rho
    alone = [zcdp_sigma(EPSILON, DELTA, bound) for bound in (first_bound, second_bound)]
    twice = sum(b**2 / (2 * s**2) for b, s in zip((first_bound, second_bound), alone, strict=True))
    assert twice == pytest.approx(2 * rho, rel=1e-3)
    assert zcdp_delta(EPSILON, twice) > 10 * DELTA


def test_two_round_noise_matches_its_calibration() -> None:
    privacy, d, m = two_rounds(), 20, 3
    calibration = party_calibration(privacy, d, m)
    exact = np.zeros(selection_dimension(d))  # 62 entries
    draws = np.stack(
        [sum(add_noise_share(exact, calibration) for _ in range(m)) for _ in range(120)]
    )  # 120 released sums of m shares: 7,440 values
    assert float(draws.std()) == pytest.approx(calibration.sum_std(m), rel=0.04)
    assert calibration.sum_std(m) == pytest.approx(calibration.sigma)
    assert abs(float(draws.mean())) < 4 * calibration.sigma / math.sqrt(draws.size)


def test_one_row_moves_each_round_by_at_most_its_bound() -> None:
    rng = np.random.default_rng(14)
    d, radius, selected_radius = 5, 2.0, 1.5
    privacy = two_rounds(2, radius, selected_radius)
    first_bound = selection_sensitivity(radius, *privacy.selection_weights())
    second_bound = row_sensitivity(selected_radius, privacy.selected_round().mean_weight)
    grid = 2**-24 * math.sqrt(selection_dimension(d))  # rounding of the two vectors
    unit = np.eye(d)
    worst_cases = [  # (old row, old label, new row, new label)
        (radius * unit[0], 1, radius * unit[1], 1),  # squares move sqrt(2) R^2
        (radius * unit[0], 1, -radius * unit[0], 1),  # class sum moves 2R
        (radius * unit[0], 1, radius * unit[1], 0),  # label flips too
        (np.zeros(d), 0, 50 * unit[2], 1),  # far outside the ball: clipped first
    ]
    largest_first = largest_second = 0.0
    for trial, before, after in neighbouring_parties(rng, 24, d, worst_cases, 200):
        moved_first = np.linalg.norm(
            selection_vector(after, privacy) - selection_vector(before, privacy)
        )
        # any selection (the bound may not depend on it): the worst rows' own columns
        selected = (
            np.array([0, 1]) if trial < len(worst_cases) else np.sort(rng.choice(d, 2, False))
        )
        moved_second = np.linalg.norm(
            selected_statistics_vector(after, privacy, selected)
            - selected_statistics_vector(before, privacy, selected)
        )
        assert moved_first <= first_bound + grid
        assert moved_second <= second_bound + grid
        assert math.hypot(moved_first, moved_second) <= sum_sensitivity(privacy, d)
        largest_first = max(largest_first, moved_first)
        largest_second = max(largest_second, moved_second)
    assert largest_first >= 0.8 * first_bound  # the worst cases come close: bounds not loose
    assert largest_second >= 0.8 * second_bound


def test_selection_keeps_the_separating_features_and_the_fit_uses_only_them() -> None:
    rng = np.random.default_rng(3)
    d, rows = 10, 400
    labels = np.tile([0, 1], rows // 2)
    features = rng.normal(size=(rows, d))
    features[labels == 1, 3] += 1.5
    features[labels == 1, 7] -= 1.0
    parties = [party(features[:200], labels[:200], "a"), party(features[200:], labels[200:], "b")]
    noiseless = PrivacySettings.row_level(
        EPSILON,
        DELTA,
        4.0,
        row_mechanism="selected_moments",
        selected_features=2,
        noise_disabled_for_testing=True,
    )
    total = sum(selection_vector(p, noiseless) for p in parties)
    np.testing.assert_array_equal(select_features(total, d, rows, noiseless), [3, 7])
    model = fit_selected_moments_release(parties, noiseless, sparse=False)
    assert set(np.flatnonzero(model.direction)) == {3, 7}
    assert model.direction[3] > 0 > model.direction[7]
    private = PrivacySettings.row_level(
        10.0, DELTA, 4.0, row_mechanism="selected_moments", selected_features=2
    )
    kept = np.flatnonzero(fit_selected_moments_release(parties, private, sparse=False).direction)
    assert set(kept) <= set(range(d)) and kept.size <= 2


def test_bad_two_round_settings_are_refused() -> None:
    with pytest.raises(PrivacySettingsError, match="selected_features must be an integer"):
        PrivacySettings.row_level(1.0, DELTA, 2.0, row_mechanism="selected_moments")
    with pytest.raises(PrivacySettingsError, match="selected_clip_norm must be finite and >= 1"):
        two_rounds(selected_radius=0.5)
    with pytest.raises(PrivacySettingsError, match="row_mechanism must be one of"):
        PrivacySettings.row_level(1.0, DELTA, 2.0, row_mechanism="laplace")
