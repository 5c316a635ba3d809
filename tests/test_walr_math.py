"""WALR maths: exact sums, sensitivity-respecting features, calibrated noise, and the fit."""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import numpy as np
import pandas as pd
import pytest
from scipy.special import expit
from sklearn.linear_model import LogisticRegression

from core.dp.discrete_privacy import binary_shift_delta, zcdp_delta
from core.dp.errors import PrivacyParameterError
from core.walr import (
    PrivacyWarning,
    WalrInputError,
    fit_walr,
    label_weighted_sum,
    prepare_binary_features,
    prepare_clipped_features,
    release_noise,
    validate_labels,
    walr_sigma,
)


def synthetic(rows: int, columns: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Test data from a known logistic model (non-secret, so a seeded numpy Generator)."""
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(rows, columns)) * rng.uniform(0.5, 2.0, size=columns)
    weights = rng.normal(size=columns)
    labels = (rng.random(rows) < expit(features @ weights - 0.7)).astype(np.int64)
    return features, labels


def sklearn_fit(
    features: np.ndarray, labels: np.ndarray, l2: float, intercept: bool
) -> LogisticRegression:
    model = LogisticRegression(
        C=1.0 / (len(labels) * l2), tol=1e-12, max_iter=10_000, fit_intercept=intercept
    )
    return model.fit(features, labels)


# ------------------------------------------------------------------------ noiseless fit


@pytest.mark.parametrize("l2", [1e-4, 1e-2])
@pytest.mark.parametrize("intercept", [True, False])
def test_noiseless_clipped_fit_equals_sklearn(l2: float, intercept: bool) -> None:
    raw, labels = synthetic(1500, 5, seed=1)
    features = prepare_clipped_features(raw, 3.0, fit_intercept=intercept)
    exact_sum = release_noise(
        label_weighted_sum(features, labels), 1.0, features.granularity, noise=False, testing=True
    )
    fit = fit_walr(features.values, exact_sum, len(labels), l2, fit_intercept=intercept)
    reference = sklearn_fit(features.values, labels, l2, intercept)
    assert fit.converged
    np.testing.assert_allclose(fit.coef, reference.coef_[0], atol=1e-4)
    assert fit.intercept == pytest.approx(float(np.ravel(reference.intercept_)[0]), abs=1e-4)


def test_noiseless_binary_fit_equals_sklearn() -> None:
    raw, labels = synthetic(1200, 6, seed=2)
    features = prepare_binary_features(pd.DataFrame(raw > 0.3, columns=list("abcdef")))
    fit = fit_walr(features.values, label_weighted_sum(features, labels), 1200, 1e-3)
    reference = sklearn_fit(features.values, labels, 1e-3, True)
    np.testing.assert_allclose(fit.coef, reference.coef_[0], atol=1e-4)
    assert fit.intercept == pytest.approx(reference.intercept_[0], abs=1e-4)
    probabilities = fit.predict_proba(features.values)
    np.testing.assert_allclose(
        probabilities, reference.predict_proba(features.values)[:, 1], atol=1e-5
    )


def test_noisy_fit_satisfies_the_first_order_condition() -> None:
    raw, labels = synthetic(800, 4, seed=3)
    features = prepare_clipped_features(raw, 2.0)
    noisy = release_noise(label_weighted_sum(features, labels), 5.0, features.granularity)
    l2 = 1e-3
    fit = fit_walr(features.values, noisy, 800, l2)
    design = features.design_matrix()
    theta = np.append(fit.coef, fit.intercept)
    gradient = (design.T @ expit(design @ theta) - noisy) / 800 + l2 * np.append(fit.coef, 0.0)
    assert fit.converged
    assert np.abs(gradient).max() < 1e-6


def test_impossible_noisy_positive_count_still_gives_a_finite_fit() -> None:
    raw, labels = synthetic(300, 3, seed=4)
    features = prepare_clipped_features(raw, 2.0)
    noisy = label_weighted_sum(features, labels)
    noisy[-1] = -25.0  # noise pushed the positive count below zero
    fit = fit_walr(features.values, noisy, 300, 1e-2)
    assert fit.converged and math.isfinite(fit.intercept)
    # the clamped count 1/2 is what the fitted probabilities add up to
    assert fit.predict_proba(features.values).sum() == pytest.approx(0.5, rel=1e-4)


# ------------------------------------------------------------------------ features and sums


def test_label_weighted_sum_equals_the_plain_float_computation() -> None:
    raw, labels = synthetic(1000, 4, seed=5)
    features = prepare_clipped_features(raw, 2.5)
    np.testing.assert_array_equal(
        label_weighted_sum(features, labels), labels @ features.design_matrix()
    )
    units = features.grid_units()
    np.testing.assert_array_equal(units * features.granularity, features.design_matrix())


def test_clipped_rows_respect_the_norm_bound_exactly_and_stay_close() -> None:
    rng = np.random.default_rng(6)
    raw = rng.normal(size=(2000, 7)) * 3
    clip = 4.0
    features = prepare_clipped_features(raw, clip)
    steps = [[Fraction(int(v)) for v in row] for row in features.values / features.granularity]
    limit = (Fraction(clip) / Fraction(features.granularity)) ** 2
    assert all(sum(v * v for v in row) <= limit for row in steps)
    norms = np.linalg.norm(raw, axis=1)
    expected = raw * np.minimum(1, clip / norms)[:, None]
    assert np.abs(features.values - expected).max() <= features.granularity
    assert features.sensitivity == pytest.approx(math.sqrt(clip**2 + 1))


def test_binary_sensitivity_counts_the_intercept_as_one_more_coordinate() -> None:
    features = np.zeros((10, 9), dtype=int)
    assert prepare_binary_features(features).sensitivity == pytest.approx(math.sqrt(10))
    assert prepare_binary_features(features, fit_intercept=False).sensitivity == 3.0


def test_binary_mode_names_the_column_and_first_bad_row() -> None:
    table = pd.DataFrame({"clicked": [0, 1, 1, 0], "age": [1, 0, 2, 3]})
    with pytest.raises(WalrInputError, match=r"column 'age', row 3: value 2\.0 is not binary"):
        prepare_binary_features(table)


def test_missing_feature_values_are_refused_with_their_position() -> None:
    raw = np.ones((5, 3))
    raw[4, 1] = np.nan
    with pytest.raises(WalrInputError, match="column 'x1', row 5: value nan is missing"):
        prepare_clipped_features(raw, 1.0)


def test_non_numeric_feature_column_is_refused() -> None:
    with pytest.raises(WalrInputError, match="column 'city': not numeric"):
        prepare_clipped_features(pd.DataFrame({"city": ["a", "b"]}), 1.0)


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        ([0, 1, 1, 2, 0], r"label, row 4: value 2 is not 0 or 1"),
        ([0, 1, 0.5], r"label, row 3: value 0\.5 is not 0 or 1"),
        (np.array(["0", "1"], dtype=object), r"label, row 1: value '0' is not 0 or 1"),
        ([0, 1, float("nan")], r"label, row 3: value nan is not 0 or 1"),
    ],
)
def test_bad_labels_are_refused(labels: object, message: str) -> None:
    with pytest.raises(WalrInputError, match=message):
        validate_labels(labels)  # type: ignore[arg-type]


def test_label_count_must_match_rows() -> None:
    features = prepare_binary_features(np.zeros((4, 2)))
    with pytest.raises(WalrInputError, match="got 3 labels for 4 feature rows"):
        label_weighted_sum(features, [0, 1, 1])


# ------------------------------------------------------------------------ release


def test_release_spread_matches_sigma() -> None:
    raw, labels = synthetic(200, 24, seed=7)
    features = prepare_clipped_features(raw, 2.0)
    exact = label_weighted_sum(features, labels)
    sigma, releases = 3.7306, 400
    noise = np.array(
        [release_noise(exact, sigma, features.granularity) - exact for _ in range(releases)]
    )
    count = noise.size  # 10,000 draws
    np.testing.assert_array_equal(
        noise / features.granularity, np.rint(noise / features.granularity)
    )
    # standard error of the sample std is sigma / sqrt(2 n) = 0.7%; allow 5 of them
    assert noise.std() == pytest.approx(sigma, rel=5 / math.sqrt(2 * count))
    assert abs(noise.mean()) < 5 * sigma / math.sqrt(count)
    # coordinates are independent: the empirical correlation of two coordinates is ~ N(0, 1/n)
    assert abs(np.corrcoef(noise[:, 0], noise[:, 1])[0, 1]) < 5 / math.sqrt(releases)


def test_release_refuses_off_grid_sums_and_silent_noiselessness() -> None:
    with pytest.raises(WalrInputError, match=r"entry 1: 0\.3 is not an exact multiple"):
        release_noise(np.array([1.0, 0.3]), 1.0, 0.25)
    with pytest.raises(WalrInputError, match="only allowed together with testing=True"):
        release_noise(np.array([1.0]), 1.0, noise=False)
    with pytest.raises(WalrInputError, match="granularity must be a power of two"):
        release_noise(np.array([0.3]), 1.0, 0.1)


# ------------------------------------------------------------------------ calibration


def test_binary_walr_sigma_meets_delta_exactly() -> None:
    features = prepare_binary_features(np.zeros((10**6, 8)))
    sigma = walr_sigma(1.0, 1e-7, features)
    assert binary_shift_delta(1.0, sigma, 9) <= 1e-7 < binary_shift_delta(1.0, sigma * 0.999, 9)


def test_clipped_walr_sigma_meets_delta_through_zcdp() -> None:
    raw, _ = synthetic(10**5, 3, seed=8)
    features = prepare_clipped_features(raw, 3.0)
    sigma = walr_sigma(0.5, 1e-6, features)
    rho = features.sensitivity**2 / (2 * sigma**2)
    assert zcdp_delta(0.5, rho) <= 1e-6


def test_delta_not_below_one_over_n_warns() -> None:
    features = prepare_binary_features(np.zeros((1000, 3)))
    with pytest.warns(PrivacyWarning, match="not below 1/N = 1/1000"):
        walr_sigma(1.0, 1e-3, features)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        walr_sigma(1.0, 1e-4, features)


@pytest.mark.parametrize(
    ("epsilon", "delta", "message"),
    [
        (0.0, 1e-6, "epsilon must be finite and > 0"),
        (-2.0, 1e-6, "epsilon must be finite and > 0"),
        (1.0, 0.0, "delta must lie strictly between 0 and 1"),
        (1.0, 1.5, "delta must lie strictly between 0 and 1"),
    ],
)
def test_bad_privacy_parameters_are_refused(epsilon: float, delta: float, message: str) -> None:
    features = prepare_binary_features(np.zeros((100, 2)))
    with pytest.raises(PrivacyParameterError, match=message):
        walr_sigma(epsilon, delta, features)


def test_fit_input_errors_say_what_is_wrong() -> None:
    values = np.zeros((5, 2))
    with pytest.raises(WalrInputError, match="n_rows=4 but features have 5 rows"):
        fit_walr(values, np.zeros(3), 4, 0.1)
    with pytest.raises(WalrInputError, match="l2 must be finite and > 0"):
        fit_walr(values, np.zeros(3), 5, 0.0)
    with pytest.raises(WalrInputError, match="noisy_sum must be 3 finite numbers"):
        fit_walr(values, np.zeros(2), 5, 0.1)
