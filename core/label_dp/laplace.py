"""Baseline: discrete Laplace noise on the grid index, clipped back into the range.

On a uniform grid of ``K`` points two labels differ by at most ``K - 1`` steps, so adding
exact discrete Laplace noise of scale ``(K - 1) / eps`` steps to the label's index is
``eps``-DP; clipping the result to the grid (the paper's Appendix F) is post-processing and
removes the far tails' damage. Working on integer indices keeps every output exactly on the
grid, with no float arithmetic on the noisy value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from core.dp.samplers import sample_discrete_laplace
from core.label_dp.errors import InvalidPriorError
from core.label_dp.losses import LossName, check_loss
from core.label_dp.mechanism import channel_expected_loss
from core.label_dp.randomness import RandomSource
from core.label_dp.validation import check_epsilon, check_prior, check_values, positions_on_grid


def check_uniform_grid(values: np.ndarray) -> None:
    """Noise-adding baselines need evenly spaced values (steps equal to 1e-9 relative)."""
    steps = np.diff(values)
    if steps.size and not np.allclose(steps, steps[0], rtol=1e-9, atol=0.0):
        bad = int(np.flatnonzero(~np.isclose(steps, steps[0], rtol=1e-9, atol=0.0))[0]) + 1
        raise InvalidPriorError(
            f"values must be evenly spaced for noise-adding mechanisms; step before values[{bad}]"
            f" is {steps[bad - 1]}, the first step is {steps[0]}"
        )


def clipped_two_sided_geometric(size: int, scale_in_steps: float) -> np.ndarray:
    """``P(clip(i + D) = j)`` for ``D`` with ``P(D = d)`` proportional to ``r^|d|``."""
    ratio = math.exp(-1.0 / scale_in_steps)
    offsets = np.arange(size)[None, :] - np.arange(size)[:, None]
    matrix = (1.0 - ratio) / (1.0 + ratio) * ratio ** np.abs(offsets)
    tail = ratio ** np.arange(size) / (1.0 + ratio)  # P(D <= -i) == P(D >= i)
    matrix[:, 0] = tail
    matrix[:, -1] = tail[::-1]
    if size == 1:
        matrix[:, 0] = 1.0
    return matrix


@dataclass(frozen=True, eq=False)
class ClippedLaplace:
    """Clipped discrete Laplace mechanism; outputs are the grid values themselves."""

    values: np.ndarray
    epsilon: float
    loss: LossName
    prior: np.ndarray

    @property
    def outputs(self) -> np.ndarray:
        return self.values

    @property
    def scale_in_steps(self) -> Fraction:
        """Exact scale: the realised privacy loss is ``(K - 1) / scale == epsilon``."""
        return Fraction(max(len(self.values) - 1, 1)) / Fraction(self.epsilon)

    def transition_matrix(self) -> np.ndarray:
        return clipped_two_sided_geometric(len(self.values), float(self.scale_in_steps))

    def expected_loss(self, prior: np.ndarray | None = None) -> float:
        weights = self.prior if prior is None else check_prior(prior, len(self.values), "prior")
        matrix = self.transition_matrix()
        return channel_expected_loss(matrix, self.values, self.outputs, weights, self.loss)

    def randomize(self, labels: np.ndarray, rng: RandomSource = None) -> np.ndarray:
        """Noisy labels from the shared exact sampler (OS CSPRNG only: ``rng`` must be None)."""
        if rng is not None:
            raise TypeError(
                "the clipped Laplace baseline draws from the exact CSPRNG sampler, which cannot "
                "be seeded; pass rng=None"
            )
        positions = positions_on_grid(self.values, labels)
        noise = sample_discrete_laplace(self.scale_in_steps, len(positions))
        return self.values[np.clip(positions + noise, 0, len(self.values) - 1)]


def clipped_laplace(
    values: object, epsilon: float, loss: str, prior: object | None = None
) -> ClippedLaplace:
    """The clipped Laplace baseline on an evenly spaced grid of ``values``."""
    loss_name = check_loss(loss)
    grid = check_values(values, loss_name)
    check_uniform_grid(grid)
    weights = check_prior(np.ones(len(grid)) if prior is None else prior, len(grid), "prior")
    return ClippedLaplace(grid, check_epsilon(epsilon), loss_name, weights)
