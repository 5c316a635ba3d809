"""Gaussian calibration: reference values, tightness, and exact discrete-Gaussian accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.dp.discrete_privacy import (
    binary_shift_delta,
    binary_shift_sigma,
    discrete_gaussian_delta,
    zcdp_delta,
    zcdp_sigma,
)
from core.dp.errors import PrivacyParameterError
from core.dp.gaussian import (
    analytic_gaussian_delta,
    analytic_gaussian_sigma,
    classic_gaussian_sigma,
)


def brute_force_delta(sigma: float, shift: int, epsilon: float) -> float:
    """sum_y max(0, P(y) - e^eps P(y - shift)) over an explicit, wide support."""
    reach = int(30 * sigma) + 4 * shift + 10
    support = np.arange(-reach, reach + 1)
    pmf = np.exp(-(support**2) / (2 * sigma**2))
    pmf /= pmf.sum()
    shifted = np.concatenate([np.zeros(shift), pmf[:-shift]])
    return float(np.clip(pmf - math.exp(epsilon) * shifted, 0, None).sum())


def test_analytic_sigma_reference_value() -> None:
    assert analytic_gaussian_sigma(1.0, 1e-5, 1.0) == pytest.approx(3.7306, abs=5e-5)


def test_classic_sigma_reference_value() -> None:
    assert classic_gaussian_sigma(1.0, 1e-5, 1.0) == pytest.approx(4.8448, abs=5e-4)


@pytest.mark.parametrize("epsilon", [0.01, 0.3, 1.0, 4.0, 20.0])
@pytest.mark.parametrize("delta", [1e-9, 1e-5, 0.05])
def test_analytic_sigma_is_the_tight_solution(epsilon: float, delta: float) -> None:
    sigma = analytic_gaussian_sigma(epsilon, delta, 1.0)
    assert analytic_gaussian_delta(sigma, epsilon, 1.0) <= delta
    assert analytic_gaussian_delta(sigma * (1 - 1e-9), epsilon, 1.0) > delta * (1 - 1e-6)
    assert analytic_gaussian_delta(sigma * (1 - 1e-6), epsilon, 1.0) > delta


def test_analytic_sigma_scales_linearly_with_sensitivity() -> None:
    base = analytic_gaussian_sigma(0.5, 1e-6, 1.0)
    assert analytic_gaussian_sigma(0.5, 1e-6, 7.5) == pytest.approx(7.5 * base, rel=1e-12)


@pytest.mark.parametrize("epsilon", [0.05, 0.5, 1.0])
def test_classic_sigma_is_valid_but_looser_than_analytic(epsilon: float) -> None:
    classic = classic_gaussian_sigma(epsilon, 1e-5, 2.0)
    assert analytic_gaussian_delta(classic, epsilon, 2.0) <= 1e-5
    assert classic > analytic_gaussian_sigma(epsilon, 1e-5, 2.0)


@pytest.mark.parametrize(
    ("epsilon", "delta", "sensitivity", "message"),
    [
        (0.0, 1e-5, 1.0, "epsilon must be finite and > 0"),
        (-1.0, 1e-5, 1.0, "epsilon must be finite and > 0"),
        (math.nan, 1e-5, 1.0, "epsilon must be finite and > 0"),
        (math.inf, 1e-5, 1.0, "epsilon must be finite and > 0"),
        (1.0, 0.0, 1.0, "delta must lie strictly between 0 and 1"),
        (1.0, 1.0, 1.0, "delta must lie strictly between 0 and 1"),
        (1.0, -0.1, 1.0, "delta must lie strictly between 0 and 1"),
        (1.0, 1e-5, 0.0, "sensitivity must be finite and > 0"),
        (1.0, 1e-5, math.inf, "sensitivity must be finite and > 0"),
    ],
)
def test_bad_parameters_are_refused(
    epsilon: float, delta: float, sensitivity: float, message: str
) -> None:
    with pytest.raises(PrivacyParameterError, match=message):
        analytic_gaussian_sigma(epsilon, delta, sensitivity)


def test_classic_sigma_refuses_epsilon_above_one() -> None:
    with pytest.raises(PrivacyParameterError, match="only valid for epsilon <= 1"):
        classic_gaussian_sigma(2.0, 1e-5, 1.0)


@pytest.mark.parametrize(
    ("sigma", "shift", "epsilon"),
    [(0.7, 1, 0.5), (2.0, 1, 2.0), (3.7306, 1, 1.0), (3.0, 2, 1.0), (5.5, 3, 0.3)],
)
def test_discrete_delta_equals_brute_force_hockey_stick(
    sigma: float, shift: int, epsilon: float
) -> None:
    exact = discrete_gaussian_delta(epsilon, sigma, shift)
    assert exact == pytest.approx(brute_force_delta(sigma, shift, epsilon), rel=1e-9, abs=1e-300)


def test_discrete_gaussian_can_leak_more_than_the_continuous_one() -> None:
    # why the discrete release is calibrated with discrete accounting, not the analytic formula
    sigma = analytic_gaussian_sigma(1.0, 1e-5, 1.0)
    assert discrete_gaussian_delta(1.0, sigma, 1) > 1.03e-5


def test_binary_shift_delta_with_one_coordinate_is_the_scalar_delta() -> None:
    for sigma, epsilon in [(1.3, 0.4), (3.7306, 1.0), (6.0, 0.5)]:
        assert binary_shift_delta(epsilon, sigma, 1) == pytest.approx(
            discrete_gaussian_delta(epsilon, sigma, 1), rel=1e-6
        )


def test_binary_shift_delta_matches_a_two_dimensional_brute_force() -> None:
    sigma, epsilon = 2.0, 0.7
    support = np.arange(-40, 41)
    pmf = np.exp(-(support**2) / (2 * sigma**2))
    pmf /= pmf.sum()
    moved = np.concatenate([[0.0], pmf[:-1]])
    joint, joint_moved = np.outer(pmf, pmf), np.outer(moved, moved)
    two_ones = float(np.clip(joint - math.exp(epsilon) * joint_moved, 0, None).sum())
    one = brute_force_delta(sigma, 1, epsilon)
    assert binary_shift_delta(epsilon, sigma, 2) == pytest.approx(max(one, two_ones), rel=1e-9)


def test_binary_shift_sigma_is_tight() -> None:
    sigma = binary_shift_sigma(1.0, 1e-5, 5)
    assert binary_shift_delta(1.0, sigma, 5) <= 1e-5
    assert binary_shift_delta(1.0, sigma * (1 - 1e-5), 5) > 1e-5
    # close to the continuous calibration for the same L2 sensitivity sqrt(5)
    assert sigma == pytest.approx(analytic_gaussian_sigma(1.0, 1e-5, math.sqrt(5)), rel=0.01)


@pytest.mark.parametrize("sigma", [0.6, 1.0, 2.5, 4.0, 9.0])
@pytest.mark.parametrize("epsilon", [0.2, 1.0, 3.0])
def test_zcdp_bound_dominates_the_exact_discrete_delta(sigma: float, epsilon: float) -> None:
    bound = zcdp_delta(epsilon, 1 / (2 * sigma**2))
    assert bound >= discrete_gaussian_delta(epsilon, sigma, 1)
    assert bound >= analytic_gaussian_delta(sigma, epsilon, 1.0)


def test_zcdp_sigma_meets_its_target_and_costs_under_fifteen_percent() -> None:
    sigma = zcdp_sigma(1.0, 1e-5, 2.0)
    assert zcdp_delta(1.0, 4.0 / (2 * sigma**2)) <= 1e-5
    assert 1.0 < sigma / analytic_gaussian_sigma(1.0, 1e-5, 2.0) < 1.15


def test_discrete_delta_refuses_a_fractional_sensitivity() -> None:
    with pytest.raises(PrivacyParameterError, match="sensitivity must be a positive integer"):
        discrete_gaussian_delta(1.0, 2.0, 1.5)  # type: ignore[arg-type]
