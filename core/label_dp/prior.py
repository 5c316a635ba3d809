"""A private estimate of the label distribution on the grid (the paper's Algorithm 4).

Changing one label moves one unit of count from one grid point to another, so the histogram
has L1 sensitivity 2 and exact discrete Laplace noise of scale ``2 / eps1`` makes it
``eps1``-DP. Negative noisy counts are clipped to zero and the rest normalised (both are
post-processing); if every count comes out zero the estimate falls back to uniform.

Budget split: the paper's Theorem 7 spends ``eps1`` on the prior and ``eps - eps1`` on the
labels. Its excess loss has a prior-error part ``O(k / (eps1 n))`` and a part ``O(eps1)``
from the budget the labels lose, balanced at ``eps1 = sqrt(k / n)`` (k grid points, n labels).
That is the default here, capped at half the budget, because the theorem only applies when
n is large enough for ``eps1`` to be well below ``eps``.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from core.dp.samplers import sample_discrete_laplace
from core.label_dp.errors import InvalidEpsilonError, InvalidLabelError
from core.label_dp.validation import check_epsilon

HISTOGRAM_SENSITIVITY = 2  # one changed label: -1 on one count, +1 on another
MAX_PRIOR_SHARE = 0.5


def default_prior_epsilon(epsilon: float, grid_size: int, label_count: int) -> float:
    """``min(sqrt(k / n), eps / 2)``: the paper's balance, capped for small data sets."""
    eps = check_epsilon(epsilon)
    if grid_size < 1 or label_count < 1:
        raise InvalidLabelError(
            f"need at least one grid point and one label; got k={grid_size}, n={label_count}"
        )
    return min(math.sqrt(grid_size / label_count), MAX_PRIOR_SHARE * eps)


def split_budget(
    epsilon: float, grid_size: int, label_count: int, prior_epsilon: float | None = None
) -> tuple[float, float]:
    """``(eps1, eps2)`` with ``eps1 + eps2 == epsilon``: prior first, then the labels."""
    eps = check_epsilon(epsilon)
    if prior_epsilon is None:
        eps1 = default_prior_epsilon(eps, grid_size, label_count)
    else:
        eps1 = check_epsilon(prior_epsilon, "prior_epsilon")
    if eps1 >= eps:
        raise InvalidEpsilonError(
            f"prior_epsilon {eps1} must be smaller than the total epsilon {eps}; "
            "nothing would be left for the labels"
        )
    return eps1, eps - eps1


def noisy_counts(counts: np.ndarray, epsilon: float) -> np.ndarray:
    """``counts`` plus exact discrete Laplace noise of scale ``2 / epsilon`` (eps-DP)."""
    eps = check_epsilon(epsilon)
    counts = np.asarray(counts)
    if counts.ndim != 1 or counts.size == 0 or not np.issubdtype(counts.dtype, np.integer):
        raise InvalidLabelError(f"counts must be a non-empty 1-D integer array; got {counts!r}")
    scale = Fraction(HISTOGRAM_SENSITIVITY) / Fraction(eps)  # exact: realised epsilon == eps
    return counts.astype(np.int64) + sample_discrete_laplace(scale, counts.size)


def counts_to_prior(noisy: np.ndarray) -> np.ndarray:
    """Clip negative counts to zero and normalise; uniform if nothing positive is left."""
    clipped = np.maximum(np.asarray(noisy, dtype=np.float64), 0.0)
    total = clipped.sum()
    if total <= 0:
        return np.full(clipped.size, 1.0 / clipped.size)
    return clipped / total


def private_prior(counts: np.ndarray, epsilon: float) -> np.ndarray:
    """An ``epsilon``-DP estimate of the label distribution from its grid histogram."""
    return counts_to_prior(noisy_counts(counts, epsilon))
