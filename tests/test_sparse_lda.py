"""Sparse LDA maths: LP optimality, debiasing, aggregation, DP noise scale, input errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.dp.discrete_privacy import zcdp_sigma
from core.sparse_lda import (
    MAX_FEATURES,
    NO_THRESHOLD,
    ColumnMismatchError,
    DimensionLimitError,
    InfeasibleProgramError,
    LabelValueError,
    LinearDiscriminant,
    LocalFitSettings,
    MissingClassError,
    NonFiniteValueError,
    PartyData,
    PrecisionMethod,
    PrivacySettings,
    PrivacySettingsError,
    ShapeError,
    ThresholdRule,
    average_noise_std,
    class_moments,
    clime_precision,
    debias,
    fit_centralized,
    fit_debiased_aggregate,
    fit_local,
    fit_moments_release,
    fit_naive_average,
    hard_threshold,
    nodewise_lasso_precision,
    noise_left_after_collusion,
    noise_share_std,
    plain_sum,
    solve_l1_dantzig,
    sum_sensitivity,
)
from core.sparse_lda.privacy import clip_to_norm, private_contribution, round_to_grid

D = 8
ROWS_PER_CLASS = 60


def toeplitz_covariance(d: int, rho: float = 0.5) -> np.ndarray:
    index = np.arange(d)
    return rho ** np.abs(index[:, None] - index[None, :])


def make_party(
    name: str, rng: np.random.Generator, d: int = D, per_class: int = ROWS_PER_CLASS
) -> PartyData:
    """Label 1 centred at 0, label 0 shifted by +1 on the first two features."""
    chol = np.linalg.cholesky(toeplitz_covariance(d))
    shift = np.zeros(d)
    shift[:2] = 1.0
    labels = np.repeat(np.array([1, 0]), per_class)
    features = rng.standard_normal((2 * per_class, d)) @ chol.T + np.where(
        labels[:, None] == 0, shift, 0.0
    )
    return PartyData(name, features, labels, tuple(f"c{k}" for k in range(d)))


@pytest.fixture(scope="module")
def parties() -> list[PartyData]:
    rng = np.random.default_rng(20160901)
    return [make_party(f"p{k}", rng) for k in range(3)]


# ----------------------------------------------------------------------------- LP


def test_l1_program_is_feasible_and_no_worse_than_feasible_competitors() -> None:
    rng = np.random.default_rng(1)
    covariance = toeplitz_covariance(D, 0.6)
    target = rng.normal(size=D)
    radius = 0.3
    solution = solve_l1_dantzig(covariance, target, radius)
    assert np.max(np.abs(covariance @ solution - target)) <= radius + 1e-7
    inverse = np.linalg.inv(covariance)
    for _ in range(50):
        slack = rng.uniform(-radius, radius, size=D)
        competitor = inverse @ (target + slack)  # feasible by construction
        assert np.abs(solution).sum() <= np.abs(competitor).sum() + 1e-7


def test_l1_program_returns_zero_when_zero_is_feasible() -> None:
    solution = solve_l1_dantzig(np.eye(3), np.array([0.1, -0.2, 0.05]), 0.25)
    np.testing.assert_allclose(solution, 0.0, atol=1e-9)


def test_infeasible_program_is_reported() -> None:
    singular = np.zeros((2, 2))
    with pytest.raises(InfeasibleProgramError, match="radius"):
        solve_l1_dantzig(singular, np.array([1.0, 0.0]), 0.1)


def test_local_direction_satisfies_its_constraint(parties: list[PartyData]) -> None:
    party = parties[0]
    settings = LocalFitSettings()
    estimate = fit_local(party, settings, debiased=False)
    moments = class_moments(party.features, party.labels)
    radius = settings.direction_radius_scale * math.sqrt(math.log(D) / party.n_rows)
    residual = moments.covariance @ estimate.sparse_direction - moments.mean_difference
    assert np.max(np.abs(residual)) <= radius + 1e-7
    assert estimate.debiased_direction is None


# ----------------------------------------------------------------------------- moments


def test_class_moments_match_direct_formula(parties: list[PartyData]) -> None:
    party = parties[1]
    moments = class_moments(party.features, party.labels)
    ones, zeros = party.features[party.labels == 1], party.features[party.labels == 0]
    np.testing.assert_allclose(moments.mean_difference, ones.mean(0) - zeros.mean(0))
    scatter = (len(ones) - 1) * np.cov(ones.T) + (len(zeros) - 1) * np.cov(zeros.T)
    np.testing.assert_allclose(moments.covariance, scatter / party.n_rows, atol=1e-12)


# ----------------------------------------------------------------------------- precision


def test_clime_columns_satisfy_constraint(parties: list[PartyData]) -> None:
    covariance = class_moments(parties[0].features, parties[0].labels).covariance
    theta = clime_precision(covariance, 0.2)
    assert np.max(np.abs(covariance @ theta - np.eye(D))) <= 0.2 + 1e-7


def test_nodewise_precision_meets_its_kkt_bound(parties: list[PartyData]) -> None:
    moments = class_moments(parties[0].features, parties[0].labels)
    penalty = 0.1
    theta = nodewise_lasso_precision(moments.centered_rows, penalty)
    product = moments.covariance @ theta
    np.testing.assert_allclose(np.diag(product), 1.0, atol=1e-6)
    tau_squared = 1.0 / np.diag(theta)
    off_diagonal = np.abs(product - np.eye(D))
    assert np.all(off_diagonal <= penalty / tau_squared[None, :] + 1e-5)


def test_nodewise_precision_is_close_to_the_inverse_with_many_rows() -> None:
    party = make_party("big", np.random.default_rng(3), per_class=3000)
    moments = class_moments(party.features, party.labels)
    theta = nodewise_lasso_precision(moments.centered_rows, 0.005)
    truth = np.linalg.inv(toeplitz_covariance(D))
    assert np.max(np.abs(theta - truth)) < 0.15


# ----------------------------------------------------------------------------- debiasing


def test_debiasing_matches_its_formula(parties: list[PartyData]) -> None:
    party = parties[2]
    settings = LocalFitSettings(precision_method=PrecisionMethod.CLIME)
    estimate = fit_local(party, settings, debiased=True)
    moments = class_moments(party.features, party.labels)
    radius = settings.clime_radius_scale * math.sqrt(math.log(D) / party.n_rows)
    theta = clime_precision(moments.covariance, radius)
    beta_hat = estimate.sparse_direction
    expected = beta_hat - theta.T @ (moments.covariance @ beta_hat - moments.mean_difference)
    np.testing.assert_allclose(estimate.debiased_direction, expected, atol=1e-8)


def test_debiasing_with_the_exact_inverse_recovers_the_exact_solution() -> None:
    rng = np.random.default_rng(4)
    covariance = toeplitz_covariance(5, 0.7)
    mean_difference = rng.normal(size=5)
    start = rng.normal(size=5)
    result = debias(start, covariance, mean_difference, np.linalg.inv(covariance))
    np.testing.assert_allclose(result, np.linalg.solve(covariance, mean_difference))


# ----------------------------------------------------------------------------- aggregation

NOISELESS = PrivacySettings.noiseless_for_testing()


def test_noiseless_aggregate_equals_plain_average(parties: list[PartyData]) -> None:
    settings = LocalFitSettings()
    model = fit_debiased_aggregate(parties, NOISELESS, settings, NO_THRESHOLD)
    locals_ = [fit_local(p, settings, debiased=True) for p in parties]
    np.testing.assert_allclose(
        model.direction, np.mean([e.debiased_direction for e in locals_], axis=0)
    )
    np.testing.assert_allclose(
        model.mean_positive, np.mean([e.mean_positive for e in locals_], axis=0)
    )
    np.testing.assert_allclose(
        model.mean_negative, np.mean([e.mean_negative for e in locals_], axis=0)
    )


def test_naive_average_uses_undebiased_directions(parties: list[PartyData]) -> None:
    model = fit_naive_average(parties, NOISELESS)
    locals_ = [fit_local(p, LocalFitSettings(), debiased=False) for p in parties]
    np.testing.assert_allclose(
        model.direction, np.mean([e.sparse_direction for e in locals_], axis=0)
    )


def test_injected_sum_is_what_the_average_comes_from(parties: list[PartyData]) -> None:
    def doubled_sum(vectors: list[np.ndarray]) -> np.ndarray:
        return 2.0 * plain_sum(vectors)

    plain = fit_naive_average(parties, NOISELESS)
    doubled = fit_naive_average(parties, NOISELESS, sum_vectors=doubled_sum)
    np.testing.assert_allclose(doubled.mean_positive, 2.0 * plain.mean_positive)


def test_hard_threshold_keeps_only_large_entries() -> None:
    vector = np.array([0.5, -0.2, 0.21, -0.6, 0.0])
    np.testing.assert_array_equal(hard_threshold(vector, 0.21), [0.5, 0.0, 0.0, -0.6, 0.0])


def test_threshold_rule_uses_union_bound_on_noise_by_default() -> None:
    rule = ThresholdRule(scale=1.0)
    assert rule.threshold(100, 10_000, 0.0) == pytest.approx(math.sqrt(math.log(100) / 10_000))
    assert rule.threshold(100, 10_000, 0.5) == pytest.approx(math.sqrt(2 * math.log(100)) * 0.5)


def test_debiased_aggregate_is_sparse_and_accurate() -> None:
    rng = np.random.default_rng(8)
    group = [make_party(f"q{k}", rng, d=10, per_class=80) for k in range(4)]
    model = fit_debiased_aggregate(group, NOISELESS)
    # The true direction Sigma^{-1} mu_d is non-zero only on features 0-2 (tridiagonal inverse).
    assert np.count_nonzero(model.direction[5:]) <= 1
    test = make_party("test", rng, d=10, per_class=2000)
    assert model.error_rate(test.features, test.labels) < 0.27  # Bayes error here ~ 0.22


# ----------------------------------------------------------------------------- decision rule


def test_decision_rule_sign_convention() -> None:
    covariance = toeplitz_covariance(3)
    mean_positive, mean_negative = np.array([1.0, 0.0, 0.0]), np.array([-1.0, 0.5, 0.0])
    direction = np.linalg.solve(covariance, mean_positive - mean_negative)
    lda = LinearDiscriminant(direction, mean_positive, mean_negative)
    np.testing.assert_array_equal(lda.predict(np.vstack([mean_positive, mean_negative])), [1, 0])
    assert lda.decision_scores(mean_positive[None, :])[0] > 0


def test_centralized_fit_classifies_fresh_rows(parties: list[PartyData]) -> None:
    model = fit_centralized(parties)
    test = make_party("test", np.random.default_rng(9), per_class=2000)
    predictions = model.predict(test.features)
    assert np.mean(predictions == test.labels) > 0.7  # Bayes accuracy here is about 0.78
    assert np.mean(predictions[test.labels == 1] == 1) > 0.6
    assert np.mean(predictions[test.labels == 0] == 0) > 0.6


# ----------------------------------------------------------------------------- DP noise


def test_noise_share_has_calibrated_scale() -> None:
    privacy = PrivacySettings(2.0, 1e-5, direction_clip_norm=1.5, mean_clip_norm=1.0)
    n_parties, d = 5, 40
    expected_sum_sigma = zcdp_sigma(2.0, 1e-5, sum_sensitivity(privacy, d))
    share = noise_share_std(privacy, d, n_parties)
    assert share == pytest.approx(expected_sum_sigma / math.sqrt(n_parties))
    zeros = np.zeros(d)
    draws = np.concatenate(
        [private_contribution(zeros, zeros, zeros, privacy, n_parties) for _ in range(50)]
    )
    assert np.std(draws) == pytest.approx(share, rel=0.05)
    assert abs(np.mean(draws)) < 4 * share / math.sqrt(draws.size)
    grid_steps = draws / privacy.grid_granularity
    np.testing.assert_array_equal(grid_steps, np.rint(grid_steps))


def test_average_noise_of_all_shares_matches_reported_std() -> None:
    privacy = PrivacySettings(1.0, 1e-6, 1.0, 1.0, colluding_parties=2)
    n_parties, d = 6, 30
    zeros = np.zeros(d)

    def one_average() -> np.ndarray:
        shares = [
            private_contribution(zeros, zeros, zeros, privacy, n_parties) for _ in range(n_parties)
        ]
        return np.mean(shares, axis=0)

    averages = np.concatenate([one_average() for _ in range(40)])
    reported = average_noise_std(privacy, d, n_parties)
    assert np.std(averages) == pytest.approx(reported, rel=0.06)


def test_collusion_margin_keeps_full_noise() -> None:
    d, m = 20, 10
    sized = PrivacySettings(1.0, 1e-5, 1.0, 1.0, colluding_parties=3)
    full = zcdp_sigma(1.0, 1e-5, sum_sensitivity(sized, d))
    assert noise_left_after_collusion(sized, d, m, colluders=3) == pytest.approx(full)
    unsized = PrivacySettings(1.0, 1e-5, 1.0, 1.0)
    left = noise_left_after_collusion(unsized, d, m, colluders=3)
    assert left == pytest.approx(full * math.sqrt((m - 3) / m))


def test_clipped_contributions_respect_the_sensitivity_bound() -> None:
    rng = np.random.default_rng(5)
    privacy = PrivacySettings(1.0, 1e-5, direction_clip_norm=2.0, mean_clip_norm=0.5)
    d = 12
    bound = sum_sensitivity(privacy, d)

    def exact_part(blocks: list[np.ndarray]) -> np.ndarray:
        clipped = [
            clip_to_norm(blocks[0], privacy.direction_clip_norm),
            clip_to_norm(blocks[1], privacy.mean_clip_norm),
            clip_to_norm(blocks[2], privacy.mean_clip_norm),
        ]
        return round_to_grid(np.concatenate(clipped), privacy.grid_granularity)

    for _ in range(200):
        first = [rng.normal(scale=5, size=d) for _ in range(3)]
        second = [rng.normal(scale=5, size=d) for _ in range(3)]
        assert np.linalg.norm(exact_part(first) - exact_part(second)) <= bound


def test_private_fit_runs_end_to_end(parties: list[PartyData]) -> None:
    privacy = PrivacySettings(50.0, 1e-5, direction_clip_norm=5.0, mean_clip_norm=3.0)
    model = fit_debiased_aggregate(parties, privacy)
    assert np.all(np.isfinite(model.direction)) and model.direction.shape == (D,)


# ----------------------------------------------------------------------------- bad input


def _rows(n: int = 6, d: int = 3) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    features = np.arange(n * d, dtype=float).reshape(n, d) % 5
    return features, np.array([0, 1] * (n // 2)), tuple(f"f{k}" for k in range(d))


def test_missing_class_is_refused_with_party_name_by_a_local_fit() -> None:
    features, _, columns = _rows()
    one_class = PartyData("clinic-b", features, np.ones(6, dtype=int), columns)
    for debiased in (True, False):
        with pytest.raises(MissingClassError, match=r"party 'clinic-b' has 0 rows with label 0"):
            fit_local(one_class, LocalFitSettings(), debiased=debiased)
    with pytest.raises(MissingClassError, match=r"party 'clinic-b'"):
        fit_debiased_aggregate([one_class, one_class], PrivacySettings.noiseless_for_testing())


def test_row_level_fit_takes_sites_with_one_class_and_refuses_a_class_missing_everywhere(
    parties: list[PartyData],
) -> None:
    """Moments add up, so a site holding only cases (or only controls) contributes exactly its
    share of the pooled statistics; a class absent from every site is refused from the counts."""
    plain = PrivacySettings.row_level(1.0, 1e-6, 3.0, noise_disabled_for_testing=True)
    mixed = parties[0]
    cases, controls = (mixed.labels == 1), (mixed.labels == 0)
    split = [
        PartyData("cases_only", mixed.features[cases], mixed.labels[cases], mixed.columns),
        PartyData("controls_only", mixed.features[controls], mixed.labels[controls], mixed.columns),
        parties[1],
    ]
    pooled_sites = fit_moments_release([mixed, parties[1]], plain)
    one_class_sites = fit_moments_release(split, plain)
    np.testing.assert_allclose(one_class_sites.direction, pooled_sites.direction, atol=1e-9)
    assert np.count_nonzero(one_class_sites.direction) > 0
    with pytest.raises(MissingClassError, match=r"0\.0 rows with label 0;.* over all parties"):
        fit_moments_release(split[:1], plain)
    # count noise of std 0.15 rows here: two rows would take a 13-sigma draw (at epsilon 100
    # its std was 0.61, and one run in a few hundred drew a count of two or more)
    noisy = PrivacySettings.row_level(1000.0, 1e-6, 3.0)
    for _ in range(5):  # a class's noisy count near zero is refused, noise level named
        with pytest.raises(MissingClassError, match=r"label 0 \(its noise has std"):
            fit_moments_release(split[:1], noisy)


def test_dimension_above_limit_is_refused() -> None:
    d = MAX_FEATURES + 1
    features = np.zeros((4, d))
    with pytest.raises(DimensionLimitError, match=str(MAX_FEATURES)):
        PartyData("wide", features, np.array([0, 1, 0, 1]), tuple(f"f{k}" for k in range(d)))


def test_mismatched_columns_name_party_and_position() -> None:
    features, labels, columns = _rows()
    first = PartyData("a", features, labels, columns)
    second = PartyData("b", features, labels, ("f0", "age", "f2"))
    with pytest.raises(ColumnMismatchError, match=r"party 'b' column 1 is 'age'"):
        fit_naive_average([first, second], NOISELESS)
    third = PartyData("c", features[:, :2], labels, columns[:2])
    with pytest.raises(ColumnMismatchError, match="party 'c' has 2 columns"):
        fit_centralized([first, third])


def test_non_finite_value_names_party_column_and_first_row() -> None:
    features, labels, columns = _rows()
    features[4, 2] = np.inf
    features[2, 1] = np.nan
    with pytest.raises(NonFiniteValueError, match=r"party 'p', column 'f1', row 3 "):
        PartyData("p", features, labels, columns)


def test_bad_labels_and_shapes_are_refused() -> None:
    features, labels, columns = _rows()
    with pytest.raises(LabelValueError, match="row 2"):
        PartyData("p", features, np.array([0, 2, 0, 1, 0, 1]), columns)
    with pytest.raises(ShapeError, match="labels must have shape"):
        PartyData("p", features, labels[:-1], columns)
    with pytest.raises(ShapeError, match="column names"):
        PartyData("p", features, labels, columns[:2])
    with pytest.raises(ShapeError, match="party 'p': no rows"):
        PartyData("p", features[:0], labels[:0], columns)


def test_bad_privacy_settings_are_refused(parties: list[PartyData]) -> None:
    with pytest.raises(PrivacySettingsError, match="epsilon"):
        PrivacySettings(0.0, 1e-5, 1.0, 1.0)
    with pytest.raises(PrivacySettingsError, match="delta"):
        PrivacySettings(1.0, 1.0, 1.0, 1.0)
    too_many = PrivacySettings(1.0, 1e-5, 1.0, 1.0, colluding_parties=3)
    with pytest.raises(PrivacySettingsError, match="no honest party"):
        fit_debiased_aggregate(parties, too_many)


def test_all_input_errors_are_value_errors() -> None:
    for error in (
        MissingClassError,
        DimensionLimitError,
        ColumnMismatchError,
        NonFiniteValueError,
        InfeasibleProgramError,
        PrivacySettingsError,
    ):
        assert issubclass(error, ValueError)
