"""Calibrating Gaussian noise: how large must sigma be for (epsilon, delta)-DP?

* :func:`analytic_gaussian_sigma` (Balle and Wang, ICML 2018) solves the *exact* condition for
  the continuous Gaussian mechanism, so it never adds more noise than needed.
* :func:`classic_gaussian_sigma` is the textbook bound (Dwork and Roth 2014, Thm. A.1). It is
  only a theorem for epsilon < 1 and is looser; kept for comparison with the WALR proposal.

The discrete Gaussian (what :mod:`core.dp.samplers` actually draws) has a slightly different
(epsilon, delta) curve, sometimes above this one: see :mod:`core.dp.discrete_privacy`.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import log_ndtr

from core.dp.errors import PrivacyParameterError

__all__ = [
    "analytic_gaussian_delta",
    "analytic_gaussian_sigma",
    "classic_gaussian_sigma",
    "validate_epsilon_delta",
]

_BISECTION_RELATIVE_WIDTH = 1e-13


def validate_epsilon_delta(epsilon: float, delta: float) -> None:
    """Refuse epsilon <= 0 (or not finite) and delta outside the open interval (0, 1)."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, int | float | np.floating):
        raise PrivacyParameterError(f"epsilon must be a number, got {epsilon!r}")
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise PrivacyParameterError(f"epsilon must be finite and > 0, got {epsilon!r}")
    if isinstance(delta, bool) or not isinstance(delta, int | float | np.floating):
        raise PrivacyParameterError(f"delta must be a number, got {delta!r}")
    if not 0 < delta < 1:
        raise PrivacyParameterError(f"delta must lie strictly between 0 and 1, got {delta!r}")


def _validate_sensitivity(sensitivity: float) -> float:
    if isinstance(sensitivity, bool) or not isinstance(sensitivity, int | float | np.floating):
        raise PrivacyParameterError(f"sensitivity must be a number, got {sensitivity!r}")
    if not (math.isfinite(sensitivity) and sensitivity > 0):
        raise PrivacyParameterError(f"sensitivity must be finite and > 0, got {sensitivity!r}")
    return float(sensitivity)


def _log_analytic_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
    """log of Phi(D/2s - eps s/D) - e^eps Phi(-D/2s - eps s/D), or -inf when it is <= 0."""
    half_ratio = sensitivity / (2.0 * sigma)
    shift = epsilon * sigma / sensitivity
    log_first = float(log_ndtr(half_ratio - shift))
    log_second = epsilon + float(log_ndtr(-half_ratio - shift))
    if log_second >= log_first:
        return -math.inf
    return log_first + math.log(-math.expm1(log_second - log_first))


def analytic_gaussian_delta(sigma: float, epsilon: float, sensitivity: float) -> float:
    """The exact delta at which N(0, sigma^2) noise on an L2-sensitivity query is eps-DP."""
    if not (math.isfinite(sigma) and sigma > 0):
        raise PrivacyParameterError(f"sigma must be finite and > 0, got {sigma!r}")
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise PrivacyParameterError(f"epsilon must be finite and > 0, got {epsilon!r}")
    return math.exp(_log_analytic_delta(sigma, epsilon, _validate_sensitivity(sensitivity)))


def analytic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """Smallest sigma (to ~1e-13 relative, rounded up) giving (epsilon, delta)-DP.

    The delta of the Gaussian mechanism decreases strictly in sigma, so bisection on log(sigma)
    converges; log_ndtr keeps the tails accurate where Phi underflows. The returned value
    always satisfies the condition (it is the upper end of the final bracket).
    """
    validate_epsilon_delta(epsilon, delta)
    sensitivity = _validate_sensitivity(sensitivity)
    log_target = math.log(delta)

    def private_enough(sigma: float) -> bool:
        return _log_analytic_delta(sigma, epsilon, sensitivity) <= log_target

    low = high = sensitivity
    while not private_enough(high):
        low, high = high, high * 2.0
    while private_enough(low):
        low, high = low / 2.0, low
        if low < sensitivity * 1e-300:
            raise PrivacyParameterError("no positive sigma found; epsilon/delta out of range")
    while high / low - 1.0 > _BISECTION_RELATIVE_WIDTH:
        middle = math.sqrt(low * high)
        if private_enough(middle):
            high = middle
        else:
            low = middle
    return high


def classic_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """sqrt(2 ln(1.25/delta)) * sensitivity / epsilon, the textbook calibration.

    Dwork and Roth prove it only for epsilon < 1 (at epsilon = 1 it still satisfies the exact
    condition, which the tests check), so epsilon > 1 is refused. Prefer
    analytic_gaussian_sigma: valid for every epsilon and always smaller.
    """
    validate_epsilon_delta(epsilon, delta)
    sensitivity = _validate_sensitivity(sensitivity)
    if epsilon > 1:
        raise PrivacyParameterError(
            f"classic Gaussian calibration is only valid for epsilon <= 1, got {epsilon!r}; "
            "use analytic_gaussian_sigma"
        )
    return math.sqrt(2.0 * math.log(1.25 / delta)) * sensitivity / epsilon
