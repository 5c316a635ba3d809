"""Differential-privacy building blocks: exact samplers and Gaussian noise calibration.

* :mod:`core.dp.samplers`: exact discrete Laplace / Gaussian samplers (CSPRNG, no floats).
* :mod:`core.dp.gaussian`: sigma for the continuous Gaussian mechanism (analytic, classic).
* :mod:`core.dp.discrete_privacy`: exact and proven (epsilon, delta) for the discrete Gaussian.
* :mod:`core.dp.accounting`: a table's releases as events, composed with dp-accounting's PLDs
  (imported on its own: it loads dp-accounting).
"""

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
    validate_epsilon_delta,
)
from core.dp.samplers import (
    gaussian_on_grid,
    laplace_on_grid,
    sample_discrete_gaussian,
    sample_discrete_laplace,
    to_exact_fraction,
)

__all__ = [
    "PrivacyParameterError",
    "analytic_gaussian_delta",
    "analytic_gaussian_sigma",
    "binary_shift_delta",
    "binary_shift_sigma",
    "classic_gaussian_sigma",
    "discrete_gaussian_delta",
    "gaussian_on_grid",
    "laplace_on_grid",
    "sample_discrete_gaussian",
    "sample_discrete_laplace",
    "to_exact_fraction",
    "validate_epsilon_delta",
    "zcdp_delta",
    "zcdp_sigma",
]
