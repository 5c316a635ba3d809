"""Privacy accounting for the discrete Gaussian that :mod:`core.dp.samplers` draws.

Why a separate calibration: the discrete Gaussian N_Z(0, sigma^2) is not the continuous one,
and at small sigma its (epsilon, delta) curve can lie *above* the continuous curve (at sigma =
3.7306, epsilon = 1, sensitivity 1: delta 1.035e-5 instead of 1e-5). Calibrating discrete noise
with the continuous formula would quietly overspend. Here:

* :func:`discrete_gaussian_delta`: exact delta in one dimension, integer sensitivity
  (Canonne, Kamath and Steinke 2020, Thm. 7).
* :func:`binary_shift_delta`: exact delta on Z^d when neighbouring inputs differ by a 0/1
  vector with at most ``max_ones`` ones (a sum of binary feature rows). The likelihood ratio
  depends on the output only through the sum of the shifted coordinates, so delta is the
  hockey-stick divergence between S and S + m, S a sum of m iid discrete Gaussians.
* :func:`zcdp_delta`: for any integer shift of L2 norm Delta, the discrete Gaussian's Renyi
  divergence of order a is at most a Delta^2 / (2 sigma^2) (CKS), i.e. rho-zCDP; converted to
  (epsilon, delta) with CKS's Corollary 13. A proven bound, slightly loose (~8% more sigma).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import numpy as np
from scipy.fft import irfft, next_fast_len, rfft
from scipy.optimize import minimize_scalar
from scipy.special import logsumexp

from core.dp.errors import PrivacyParameterError
from core.dp.gaussian import analytic_gaussian_sigma, validate_epsilon_delta
from core.dp.samplers import to_exact_fraction

__all__ = [
    "binary_shift_delta",
    "binary_shift_sigma",
    "discrete_gaussian_delta",
    "zcdp_delta",
    "zcdp_sigma",
]

_TAIL_WIDTH_SIGMAS = 12  # exp(-12^2/2) ~ 5e-32: mass beyond is below float64 resolution
_CHUNK = 1 << 20
_SIGMA_RELATIVE_TOLERANCE = 1e-6


def _check_epsilon(epsilon: float) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, int | float | np.floating):
        raise PrivacyParameterError(f"epsilon must be a number, got {epsilon!r}")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise PrivacyParameterError(f"epsilon must be finite and >= 0, got {epsilon!r}")
    return float(epsilon)


def _check_positive_integer(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise PrivacyParameterError(f"{name} must be a positive integer, got {value!r}")
    if not (math.isfinite(value) and float(value).is_integer() and value >= 1):
        raise PrivacyParameterError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


# ------------------------------------------------------------------------ one dimension


def _log_mass_from(start: int, sigma_squared: float, width: int) -> float:
    """log sum_{y >= start} exp(-y^2 / (2 sigma^2)), dropping terms below ~1e-31 relative."""
    lower = max(start, -width)
    if lower >= 0:
        # Relative to the first term, term lower + j is exp(-(2 lower j + j^2) / (2 sigma^2)).
        upper = lower + min(width, math.ceil(75.0 * sigma_squared / max(lower, 1))) + 2
    else:
        upper = width
    pieces = []
    for chunk_start in range(lower, upper + 1, _CHUNK):
        values = np.arange(chunk_start, min(chunk_start + _CHUNK, upper + 1), dtype=np.float64)
        pieces.append(float(logsumexp(-(values * values) / (2.0 * sigma_squared))))
    return float(logsumexp(pieces))


def discrete_gaussian_delta(epsilon: float, sigma: float | Fraction, sensitivity: int) -> float:
    """Exact delta of q + N_Z(0, sigma^2) for an integer query of integer sensitivity D.

    delta = P[Y > eps sigma^2/D - D/2] - e^eps P[Y > eps sigma^2/D + D/2], Y ~ N_Z(0, sigma^2).
    The thresholds are exact rationals; the tail masses are summed in log space.
    """
    epsilon = _check_epsilon(epsilon)
    exact_sigma = to_exact_fraction(sigma, "sigma")
    steps = _check_positive_integer(sensitivity, "sensitivity")
    centre = Fraction(epsilon) * exact_sigma**2 / steps
    first_start = math.floor(centre - Fraction(steps, 2)) + 1
    second_start = math.floor(centre + Fraction(steps, 2)) + 1
    sigma_squared = float(exact_sigma) ** 2
    width = math.ceil(_TAIL_WIDTH_SIGMAS * float(exact_sigma)) + steps + 2
    log_total = _log_mass_from(-width, sigma_squared, width)
    log_first = _log_mass_from(first_start, sigma_squared, width)
    log_second = epsilon + _log_mass_from(second_start, sigma_squared, width)
    if log_second >= log_first:
        return 0.0
    return math.exp(log_first - log_total) * -math.expm1(log_second - log_first)


# ------------------------------------------------------------------------ binary shifts


def binary_shift_delta(epsilon: float, sigma: float | Fraction, max_ones: int) -> float:
    """Exact delta of x + N_Z(0, sigma^2)^d when neighbours differ by a 0/1 (or 0/-1) vector.

    Worst case over the number of ones m = 1..max_ones of
    sum_t max(0, P_m(t) - e^eps P_m(t - m)), with P_m the pmf of a sum of m iid N_Z(0, sigma^2),
    computed by FFT (absolute error ~1e-13, negligible against any useful delta).
    """
    epsilon = _check_epsilon(epsilon)
    exact_sigma = to_exact_fraction(sigma, "sigma")
    max_ones = _check_positive_integer(max_ones, "max_ones")
    spread = float(exact_sigma)
    half_width = math.ceil(_TAIL_WIDTH_SIGMAS * spread) + 2
    support = np.arange(-half_width, half_width + 1, dtype=np.float64)
    log_pmf = -(support * support) / (2.0 * spread * spread)
    pmf = np.exp(log_pmf - logsumexp(log_pmf))
    length = next_fast_len(max_ones * (2 * half_width) + 1 + max_ones, real=True)
    spectrum = rfft(pmf, length)
    factor = math.exp(epsilon)
    worst = 0.0
    power = np.ones_like(spectrum)
    for ones in range(1, max_ones + 1):
        power = power * spectrum
        summed = np.clip(irfft(power, length)[: ones * 2 * half_width + 1], 0.0, None)
        shifted = np.concatenate([np.zeros(ones), summed[:-ones]])
        worst = max(worst, float(np.clip(summed - factor * shifted, 0.0, None).sum()))
    return min(worst, 1.0)


# ------------------------------------------------------------------------ zCDP bound


def zcdp_delta(epsilon: float, rho: float) -> float:
    """delta such that rho-zCDP implies (epsilon, delta)-DP (CKS 2020, Corollary 13).

    delta = inf_{a > 1} exp((a-1)(a rho - epsilon)) / (a-1) * (1 - 1/a)^a. Every order a gives
    a valid bound, so an imprecise minimisation can only err on the safe side.
    """
    epsilon = _check_epsilon(epsilon)
    if not (math.isfinite(rho) and rho > 0):
        raise PrivacyParameterError(f"rho must be finite and > 0, got {rho!r}")

    def log_delta(log_order_minus_one: float) -> float:
        excess = math.exp(log_order_minus_one)
        order = 1.0 + excess
        return (
            excess * (order * rho - epsilon)
            + order * math.log1p(-1.0 / order)
            - log_order_minus_one
        )

    grid = np.linspace(-15.0, 15.0, 121)
    best = int(np.argmin([log_delta(float(x)) for x in grid]))
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, grid.size - 1)]
    refined = minimize_scalar(log_delta, bounds=(low, high), method="bounded")
    value = min(float(refined.fun), log_delta(float(grid[best])))
    return math.exp(min(value, 0.0))


# ------------------------------------------------------------------------ calibration


def _smallest_sigma(delta_at: Callable[[float], float], target: float, guess: float) -> float:
    """Bisect for the smallest sigma with delta_at(sigma) <= target (delta_at decreasing)."""
    low, high = guess * 0.97, guess * 1.03
    while delta_at(high) > target:
        low, high = high, high * 1.5
    while delta_at(low) <= target:
        low, high = low / 1.5, low
    while high / low - 1.0 > _SIGMA_RELATIVE_TOLERANCE:
        middle = math.sqrt(low * high)
        if delta_at(middle) <= target:
            high = middle
        else:
            low = middle
    return high


def binary_shift_sigma(epsilon: float, delta: float, max_ones: int) -> float:
    """Smallest discrete-Gaussian sigma with binary_shift_delta <= delta (to 1e-6 relative)."""
    validate_epsilon_delta(epsilon, delta)
    max_ones = _check_positive_integer(max_ones, "max_ones")
    guess = analytic_gaussian_sigma(epsilon, delta, math.sqrt(max_ones))
    return _smallest_sigma(lambda s: binary_shift_delta(epsilon, s, max_ones), delta, guess)


def zcdp_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """Smallest sigma such that the discrete Gaussian's zCDP bound gives (epsilon, delta)."""
    validate_epsilon_delta(epsilon, delta)
    if not (math.isfinite(sensitivity) and sensitivity > 0):
        raise PrivacyParameterError(f"sensitivity must be finite and > 0, got {sensitivity!r}")
    guess = analytic_gaussian_sigma(epsilon, delta, sensitivity)
    return _smallest_sigma(
        lambda s: zcdp_delta(epsilon, sensitivity**2 / (2.0 * s * s)), delta, guess
    )
