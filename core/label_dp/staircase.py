"""Baseline: the discrete staircase mechanism (Geng & Viswanath), clipped to the grid.

Noise ``d`` (in grid steps, sensitivity ``D = K - 1``) has probability proportional to
``exp(-eps * floor(|d| / D))`` times ``1`` on the first ``r`` steps of each period and
``exp(-eps)`` on the remaining ``D - r``; it is symmetric. Shifting ``d`` by at most ``D``
crosses at most one step down, so it is eps-DP for every ``r`` in ``1..D`` (the tests check
the matrix). ``r`` is chosen to minimise the expected loss under the prior.

Exactness: the clipped transition matrix is computed in closed form and sampled exactly from
integer weights (see ``channel``), whose privacy loss is verified. A direct sampler of the
infinite staircase would need exact Bernoulli(exp(-eps)) draws with a float eps; the clipped,
finite version needs none.
"""

from __future__ import annotations

import math

import numpy as np

from core.label_dp.channel import FiniteMechanism, QuantisedChannel
from core.label_dp.exponential import CALIBRATION_MARGIN
from core.label_dp.laplace import check_uniform_grid
from core.label_dp.losses import check_loss
from core.label_dp.mechanism import channel_expected_loss
from core.label_dp.validation import check_epsilon, check_prior, check_values

MAX_STEP_CANDIDATES = 64


def staircase_pmf_and_tails(span: int, step: int, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """``P(D = d)`` and ``P(D >= d)`` for ``d = 0 .. span`` (``span`` = sensitivity in steps)."""
    decay = math.exp(-epsilon)
    offsets = np.arange(span + 1)
    periods, within = np.divmod(offsets, span)
    shape = decay**periods * np.where(within < step, 1.0, decay)
    one_side = float(shape[:span].sum()) / (1.0 - decay)  # sum over d >= 0 of the shape
    normaliser = 2.0 * one_side - 1.0  # both sides, d = 0 counted once
    pmf = shape / normaliser
    # P(D >= d) = P(d <= D < span) + decay * P(D >= 0), for 0 <= d <= span.
    head = np.concatenate((np.cumsum(pmf[:span][::-1])[::-1], [0.0]))
    tails = head + decay * one_side / normaliser
    return pmf, tails


def staircase_matrix(size: int, step: int, epsilon: float) -> np.ndarray:
    """Transition matrix of ``clip(i + D)`` on a grid of ``size`` points."""
    if size == 1:
        return np.ones((1, 1))
    span = size - 1
    pmf, tails = staircase_pmf_and_tails(span, step, epsilon)
    offsets = np.abs(np.arange(size)[None, :] - np.arange(size)[:, None])
    matrix = pmf[offsets]
    matrix[:, 0] = tails[np.arange(size)]  # P(D <= -i) == P(D >= i)
    matrix[:, -1] = tails[np.arange(size)[::-1]]
    return matrix


def staircase_mechanism(
    values: object, epsilon: float, loss: str, prior: object | None = None
) -> FiniteMechanism:
    """The clipped discrete staircase with the step width best for ``prior`` (uniform if None)."""
    loss_name = check_loss(loss)
    grid = check_values(values, loss_name)
    check_uniform_grid(grid)
    eps = check_epsilon(epsilon)
    weights = check_prior(np.ones(len(grid)) if prior is None else prior, len(grid), "prior")
    target = eps * (1.0 - CALIBRATION_MARGIN)  # the staircase meets its bound with equality
    span = max(len(grid) - 1, 1)
    steps = np.unique(np.linspace(1, span, min(span, MAX_STEP_CANDIDATES)).round().astype(int))
    best = min(
        steps,
        key=lambda step: channel_expected_loss(
            staircase_matrix(len(grid), int(step), target), grid, grid, weights, loss_name
        ),
    )
    channel = QuantisedChannel.from_matrix(staircase_matrix(len(grid), int(best), target), eps)
    return FiniteMechanism("staircase", grid, grid.copy(), eps, loss_name, weights, channel)
