"""The exact samplers draw exactly the distributions they claim.

Goodness of fit uses Pearson's chi-square with a fixed sample size; a correct sampler fails a
single check with probability 1e-4, while a wrong normalisation, scale or tail shows up at
p-values far below that at these sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from core.dp.errors import PrivacyParameterError
from core.dp.samplers import (
    _bernoulli_exp_neg,
    gaussian_on_grid,
    laplace_on_grid,
    sample_discrete_gaussian,
    sample_discrete_laplace,
    to_exact_fraction,
)

SIGNIFICANCE = 1e-4


def discrete_laplace_pmf(values: np.ndarray, scale: float) -> np.ndarray:
    ratio = math.exp(-1.0 / scale)
    return (1 - ratio) / (1 + ratio) * ratio ** np.abs(values)


def discrete_gaussian_pmf(values: np.ndarray, sigma: float) -> np.ndarray:
    reach = int(40 * sigma) + 40
    support = np.arange(-reach, reach + 1)
    normaliser = np.exp(-(support**2) / (2 * sigma**2)).sum()
    return np.exp(-(values.astype(float) ** 2) / (2 * sigma**2)) / normaliser


def chi_square_pvalue(samples: np.ndarray, pmf: Callable[[np.ndarray], np.ndarray]) -> float:
    """Bins every value with expected count >= 5; everything else is pooled into one bin."""
    size = samples.size
    reach = 1
    while pmf(np.array([reach]))[0] * size >= 5:
        reach += 1
    values = np.arange(-reach + 1, reach)
    expected = pmf(values) * size
    observed = np.array([(samples == v).sum() for v in values], dtype=float)
    expected = np.append(expected, size - expected.sum())
    observed = np.append(observed, size - observed.sum())
    return float(stats.chisquare(observed, expected).pvalue)


@pytest.mark.parametrize("scale", [1.0, 2.5, Fraction(7, 3)])
def test_discrete_laplace_matches_its_pmf(scale: float | Fraction) -> None:
    samples = sample_discrete_laplace(scale, 40_000)
    assert samples.dtype == np.int64 and samples.shape == (40_000,)
    pvalue = chi_square_pvalue(samples, lambda v: discrete_laplace_pmf(v, float(scale)))
    assert pvalue > SIGNIFICANCE


def test_discrete_laplace_with_a_huge_denominator_matches_its_pmf() -> None:
    # numerator > 2^32 takes the arbitrary-precision Bernoulli path
    scale = Fraction(10**12 + 1, 10**11)
    samples = sample_discrete_laplace(scale, 20_000)
    assert chi_square_pvalue(samples, lambda v: discrete_laplace_pmf(v, float(scale))) > (
        SIGNIFICANCE
    )


@pytest.mark.parametrize("sigma", [0.8, 3.7306, 12.5])
def test_discrete_gaussian_matches_its_pmf(sigma: float) -> None:
    samples = sample_discrete_gaussian(sigma, 40_000)
    assert samples.dtype == np.int64 and samples.shape == (40_000,)
    assert chi_square_pvalue(samples, lambda v: discrete_gaussian_pmf(v, sigma)) > SIGNIFICANCE


def test_discrete_gaussian_variance_is_sigma_squared() -> None:
    sigma, size = 10.0, 100_000
    samples = sample_discrete_gaussian(sigma, size).astype(float)
    # At sigma = 10 the discrete variance equals sigma^2 to far below 1e-100; the estimate's
    # standard error is sigma^2 sqrt(2/n) = 0.45% here, and we allow 5 standard errors.
    assert samples.var() == pytest.approx(sigma**2, rel=5 * math.sqrt(2 / size))
    assert abs(samples.mean()) < 5 * sigma / math.sqrt(size)


def test_discrete_laplace_variance_matches_closed_form() -> None:
    scale, size = 4.0, 100_000
    ratio = math.exp(-1 / scale)
    variance = 2 * ratio / (1 - ratio) ** 2
    samples = sample_discrete_laplace(scale, size).astype(float)
    # kurtosis of this law is ~6, so var(X^2) ~ 5 variance^2
    assert samples.var() == pytest.approx(variance, rel=5 * math.sqrt(5 / size))


def test_bernoulli_exp_neg_has_the_exact_success_rate() -> None:
    size = 200_000
    gammas = [Fraction(0), Fraction(1, 3), Fraction(5, 2), Fraction(7)]
    denominator = 6
    table = [int(g * denominator) for g in gammas]
    keys = np.repeat(np.arange(len(gammas)), size // len(gammas))
    outcome = _bernoulli_exp_neg(table, denominator, keys)
    for index, gamma in enumerate(gammas):
        rate = outcome[keys == index].mean()
        expected = math.exp(-gamma)
        error = math.sqrt(expected * (1 - expected) / (size // len(gammas)))
        assert abs(rate - expected) <= 5 * error + 1e-12


def test_grid_noise_is_an_exact_multiple_of_the_granularity() -> None:
    granularity = 2.0**-10
    noise = gaussian_on_grid(1.5, granularity, 20_000)
    steps = noise / granularity
    np.testing.assert_array_equal(steps, np.round(steps))
    assert noise.std() == pytest.approx(1.5, rel=0.03)
    laplace = laplace_on_grid(2.0, 0.25, 20_000)
    np.testing.assert_array_equal(laplace / 0.25, np.round(laplace / 0.25))
    # discrete Laplace(8) in steps of 1/4: variance 2r/(1-r)^2 / 16 with r = exp(-1/8)
    ratio = math.exp(-1 / 8)
    assert laplace.var() == pytest.approx(2 * ratio / (1 - ratio) ** 2 / 16, rel=0.06)


def test_floats_are_read_as_their_exact_binary_value() -> None:
    assert to_exact_fraction(0.1, "scale") == Fraction(3602879701896397, 36028797018963968)
    assert to_exact_fraction(Fraction(1, 10), "scale") == Fraction(1, 10)
    assert to_exact_fraction(3, "scale") == 3


def test_zero_size_gives_an_empty_int_array() -> None:
    assert sample_discrete_gaussian(2.0, 0).shape == (0,)
    assert sample_discrete_laplace(2.0, 0).dtype == np.int64


@pytest.mark.parametrize(
    ("scale", "size", "message"),
    [
        (0.0, 10, "scale must be > 0"),
        (-1.0, 10, "scale must be > 0"),
        (math.nan, 10, "scale must be finite"),
        (math.inf, 10, "scale must be finite"),
        (True, 10, "scale must be a float"),
        ("2", 10, "scale must be a float"),
        (1.0, -1, "size must be a non-negative integer"),
        (1.0, 2.5, "size must be a non-negative integer"),
    ],
)
def test_bad_parameters_are_refused(scale: object, size: object, message: str) -> None:
    with pytest.raises(PrivacyParameterError, match=message):
        sample_discrete_laplace(scale, size)  # type: ignore[arg-type]


def test_bad_sigma_and_granularity_are_refused() -> None:
    with pytest.raises(PrivacyParameterError, match="sigma must be > 0"):
        sample_discrete_gaussian(0.0, 5)
    with pytest.raises(PrivacyParameterError, match="granularity must be > 0"):
        gaussian_on_grid(1.0, 0.0, 5)
    with pytest.raises(PrivacyParameterError, match=r"sigma .* too large"):
        sample_discrete_gaussian(2.0**60, 5)
