"""Differential-privacy building blocks: exact samplers and Gaussian noise calibration.

* :mod:`core.dp.samplers`: exact discrete Laplace / Gaussian samplers (CSPRNG, no floats).
* :mod:`core.dp.gaussian`: sigma for the continuous Gaussian mechanism (analytic, classic).
* :mod:`core.dp.discrete_privacy`: exact and proven (epsilon, delta) for the discrete Gaussian.
* :mod:`core.dp.accounting`: a table's releases as events, composed with dp-accounting's PLDs
  (imported on its own: it loads dp-accounting).
"""

from core.lazy import lazy_exports

_WHERE = {  # name -> the module that defines it, imported on first use
    "analytic_gaussian_delta": "core.dp.gaussian",
    "analytic_gaussian_sigma": "core.dp.gaussian",
    "binary_shift_delta": "core.dp.discrete_privacy",
    "binary_shift_sigma": "core.dp.discrete_privacy",
    "classic_gaussian_sigma": "core.dp.gaussian",
    "discrete_gaussian_delta": "core.dp.discrete_privacy",
    "gaussian_on_grid": "core.dp.samplers",
    "laplace_on_grid": "core.dp.samplers",
    "PrivacyParameterError": "core.dp.errors",
    "sample_discrete_gaussian": "core.dp.samplers",
    "sample_discrete_laplace": "core.dp.samplers",
    "to_exact_fraction": "core.dp.samplers",
    "validate_epsilon_delta": "core.dp.gaussian",
    "zcdp_delta": "core.dp.discrete_privacy",
    "zcdp_sigma": "core.dp.discrete_privacy",
}

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


__getattr__ = lazy_exports(__name__, _WHERE)
