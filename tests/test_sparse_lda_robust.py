"""Sparse LDA at awkward sites and the row-level mechanism: bounded fits, named refusals,
noise that matches its calibration, and a sensitivity bound that holds for any row."""

from __future__ import annotations

import math

import numpy as np
import pytest
from neighbouring_rows import neighbouring_parties
from sparse_lda_sites import breast_sites, stressed_sites, synthetic_sites

from core.dp.discrete_privacy import zcdp_sigma
from core.sparse_lda import (
    ContributionError,
    DegenerateDataError,
    LocalFitSettings,
    PartyData,
    PrivacySettings,
    calibrate,
    check_contribution,
    fit_debiased_aggregate,
    fit_local,
    fit_naive_average,
    model_from_statistics,
    party_calibration,
    party_contribution,
    row_sensitivity,
    statistics_vector,
    sum_sensitivity,
)
from core.sparse_lda.moments_release import pack_symmetric, unpack_symmetric
from core.sparse_lda.privacy import add_noise_share

NOISELESS = PrivacySettings.noiseless_for_testing()
DIRECTION_BOUND = 100.0  # |beta_tilde| entries on standardised features; the bug gave 1e14
ERROR_MARGIN = 0.03  # about 3 of ~110 held-out rows


@pytest.mark.parametrize("build", [breast_sites, synthetic_sites])
def test_awkward_sites_give_bounded_fits_and_beat_or_match_naive_averaging(build) -> None:
    sites = build(0)
    estimates = [fit_local(p, LocalFitSettings(), debiased=True) for p in sites.parties]
    for estimate in estimates:
        assert np.all(np.isfinite(estimate.debiased_direction))
        assert np.max(np.abs(estimate.debiased_direction)) <= DIRECTION_BOUND
    flat = {e.party: set(e.degenerate_columns) for e in estimates}
    assert flat["site_a"] == {"x3", "x13"} and flat["site_b"] == {"x7"}
    assert not flat["site_c"] and not flat["site_d"]
    columns = sites.parties[0].columns
    for estimate in estimates:  # left at zero where the site has no information
        for column in estimate.degenerate_columns:
            assert estimate.debiased_direction[columns.index(column)] == 0.0
    test = (sites.test_features, sites.test_labels)
    debiased = fit_debiased_aggregate(sites.parties, NOISELESS).error_rate(*test)
    naive = fit_naive_average(sites.parties, NOISELESS).error_rate(*test)
    assert debiased <= naive + ERROR_MARGIN


def test_harsher_random_sites_still_give_finite_bounded_fits() -> None:
    """Sites of a dozen rows for 30 features, classes of two rows, duplicated columns."""
    for seed in range(8):
        for party in stressed_sites(seed).parties:
            estimate = fit_local(party, LocalFitSettings(), debiased=True)
            for direction in (estimate.sparse_direction, estimate.debiased_direction):
                assert np.all(np.isfinite(direction))
                assert np.max(np.abs(direction)) <= DIRECTION_BOUND, (seed, party.name)


def _party(name: str, features: np.ndarray, labels: np.ndarray) -> PartyData:
    return PartyData(name, features, labels, tuple(f"c{k}" for k in range(features.shape[1])))


def test_impossible_inputs_are_refused_by_name() -> None:
    rng = np.random.default_rng(3)
    labels = np.repeat([0, 1], 20)
    flat = _party("clinic", np.full((40, 3), 2.5), labels)
    with pytest.raises(DegenerateDataError, match=r"party 'clinic': every column .* 'c0'"):
        fit_local(flat, LocalFitSettings(), debiased=True)
    parties = []
    for name in ("north", "south"):
        features = rng.normal(size=(40, 4))
        features[:, 2] = 7.0  # never measured anywhere
        parties.append(_party(name, features, labels))
    with pytest.raises(DegenerateDataError, match=r"column 'c2' is constant .* every party"):
        fit_debiased_aggregate(parties, NOISELESS)


def test_broken_contributions_are_refused_with_the_party_name() -> None:
    rng = np.random.default_rng(4)
    party = _party("east", rng.normal(size=(40, 4)), np.repeat([0, 1], 20))
    estimate = fit_local(party, LocalFitSettings(), debiased=True)
    nan = estimate.debiased_direction.copy()
    nan[1] = np.nan
    broken = type(estimate)(**{**estimate.__dict__, "debiased_direction": nan})
    for privacy in (NOISELESS, PrivacySettings(1.0, 1e-6, 2.0, 2.0)):
        with pytest.raises(ContributionError, match=r"party 'east'.* coordinate \d+ is nan"):
            party_contribution(broken, privacy, 3, debiased=True)
    huge = type(estimate)(**{**estimate.__dict__, "debiased_direction": np.full_like(nan, 1e14)})
    with pytest.raises(ContributionError, match=r"party 'east'.*beyond the bound"):
        party_contribution(huge, NOISELESS, 3, debiased=True)
    with pytest.raises(ContributionError, match=r"party 'west'.*L2 norm .* > its bound"):
        check_contribution("west", np.ones(4) * 10, 5.0)


def test_row_level_noise_matches_its_calibration() -> None:
    privacy = PrivacySettings.row_level(2.0, 1e-6, 3.0)
    d, m = 4, 5
    calibration = party_calibration(privacy, d, m)
    assert calibration.sigma == pytest.approx(
        zcdp_sigma(2.0, 1e-6, row_sensitivity(3.0, privacy.mean_weight) + 2**-24 * math.sqrt(20))
    )
    assert calibration == calibrate(privacy, d, m)  # one calibration, whoever asks
    exact = np.zeros(2 * d + 2 + d * (d + 1) // 2)
    draws = np.stack(
        [sum(add_noise_share(exact, calibration) for _ in range(m)) for _ in range(400)]
    )  # 400 released sums of m shares, 20 coordinates each: 8,000 values
    spread = float(draws.std())
    assert spread == pytest.approx(calibration.sum_std(m), rel=0.04)
    assert calibration.sum_std(m) == pytest.approx(calibration.sigma)
    assert abs(float(draws.mean())) < 4 * calibration.sigma / math.sqrt(draws.size)


def test_class_counts_are_read_against_the_public_row_count() -> None:
    """n0 = N - n1 with N exact: equal noise on both released counts cancels, and each count's
    noise reaches the class means at half the variance."""
    rng = np.random.default_rng(8)
    labels = np.repeat([0, 1], [70, 30])
    party = _party("north", rng.normal(size=(100, 4)) + labels[:, None], labels)
    privacy = PrivacySettings.row_level(1.0, 1e-6, 3.0)
    exact = statistics_vector(party, privacy)
    reference = model_from_statistics(exact, 4, 100, 0.0, privacy)
    shifted = exact.copy()
    shifted[8:10] += 12.0 * privacy.mean_weight  # both counts read 12 rows too many
    model = model_from_statistics(shifted, 4, 100, 0.0, privacy)
    np.testing.assert_allclose(model.mean_positive, reference.mean_positive, rtol=1e-12)
    np.testing.assert_allclose(model.mean_negative, reference.mean_negative, rtol=1e-12)
    implied = []
    for _ in range(2000):
        noisy = exact.copy()
        noisy[8:10] += rng.normal(0.0, 10.0, 2) * privacy.mean_weight
        means = model_from_statistics(noisy, 4, 100, 10.0, privacy).mean_positive
        implied.append(exact[0] / privacy.mean_weight / means[0])  # the count it divided by
    assert np.std(implied) == pytest.approx(10.0 / math.sqrt(2.0), rel=0.08)
    assert np.mean(implied) == pytest.approx(30.0, abs=0.5)


def test_packing_keeps_the_frobenius_norm() -> None:
    matrix = np.random.default_rng(5).normal(size=(5, 5))
    matrix = matrix + matrix.T
    packed = pack_symmetric(matrix)
    assert np.linalg.norm(packed) == pytest.approx(np.linalg.norm(matrix))
    np.testing.assert_allclose(unpack_symmetric(packed, 5), matrix)


@pytest.mark.parametrize("share", [0.4, 0.9])  # w^2 <= 2 R^2 and w^2 > 2 R^2
def test_one_row_moves_the_statistics_by_at_most_the_sensitivity(share: float) -> None:
    rng = np.random.default_rng(6)
    d, radius = 5, 2.0
    privacy = PrivacySettings.row_level(1.0, 1e-6, radius, mean_budget_share=share)
    bound = sum_sensitivity(privacy, d)
    exact = row_sensitivity(radius, privacy.mean_weight)  # without the grid's rounding
    w2, r2 = privacy.mean_weight**2, radius**2
    cosine = max(-w2 / (2 * r2), -1.0)  # the angle that moves sums and M most together
    unit = np.eye(d)
    worst_cases = [  # (old row, old label, new row, new label)
        (radius * unit[0], 1, radius * (cosine * unit[0] + math.sqrt(1 - cosine**2) * unit[1]), 1),
        (radius * unit[0], 1, radius * unit[1], 0),  # orthogonal, and the label flips
        (radius * unit[0], 1, radius * unit[1], 1),  # orthogonal rows: M moves sqrt(2) R^2
        (radius * unit[0], 1, -radius * unit[0], 1),  # opposite rows: class sum moves 2R
        (np.zeros(d), 0, 50 * unit[2], 1),  # far outside the ball: clipped first
    ]
    moves = []
    for _, before, after in neighbouring_parties(rng, 30, d, worst_cases, 300):
        moved = float(
            np.linalg.norm(statistics_vector(after, privacy) - statistics_vector(before, privacy))
        )
        assert moved <= bound
        moves.append(moved)
    # the larger of the two constructed cases reaches the bound: it is exact, not loose
    assert max(moves[:2]) == pytest.approx(exact, rel=1e-6)
    assert max(moves) <= bound
