"""RR-on-Bins (Ghazi et al., ICLR 2023): the loss-optimal eps-label-DP randomiser for a prior.

Sorted label values are cut into ``m`` runs (bins); a label is replaced by its bin's value with
probability ``E / (E + m - 1)`` and by each other bin's value with probability
``1 / (E + m - 1)``, where ``E = e^eps``. The paper proves that for squared, absolute and
Poisson loss some such mechanism minimises the expected loss over *all* eps-DP mechanisms;
``partition_search`` finds the best bins exactly.

Values with zero prior weight do not affect the expected loss, so the search runs on the
support only; each such value is then sent to the bin whose output suits it best, which keeps
the mechanism monotone and useful if the (possibly noisy) prior missed it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from core.label_dp.bin_costs import bin_costs_for
from core.label_dp.errors import InvalidEpsilonError
from core.label_dp.losses import LossName, check_loss, pointwise_loss
from core.label_dp.partition_search import optimal_partition
from core.label_dp.randomness import RandomSource, bernoulli_at_most, integers_below
from core.label_dp.validation import check_epsilon, check_prior, check_values, positions_on_grid

MAX_EPSILON = 700.0  # e^eps must stay a finite double
_CHUNK_ENTRIES = 4_000_000


@dataclass(frozen=True, eq=False)
class RROnBins:
    """Randomised response over bin values; ``bin_of[i]`` is the bin of ``values[i]``."""

    values: np.ndarray
    prior: np.ndarray
    epsilon: float
    loss: LossName
    outputs: np.ndarray
    bin_of: np.ndarray

    @property
    def bin_count(self) -> int:
        return len(self.outputs)

    @property
    def keep_probability(self) -> float:
        """Chance that a label is replaced by its own bin's value."""
        return 1.0 / (1.0 + (self.bin_count - 1) * math.exp(-self.epsilon))

    def transition_matrix(self) -> np.ndarray:
        """Rows: input values; columns: outputs. Dense ``k x m`` (mind the size for big k)."""
        m = self.bin_count
        other = (1.0 - self.keep_probability) / (m - 1) if m > 1 else 0.0
        matrix = np.full((len(self.values), m), other)
        matrix[np.arange(len(self.values)), self.bin_of] = self.keep_probability
        return matrix

    def expected_loss(self, prior: np.ndarray | None = None) -> float:
        """Expected loss for labels drawn from ``prior`` (default: the prior it was built for)."""
        weights = self.prior if prior is None else check_prior(prior, len(self.values), "prior")
        m = self.bin_count
        keep = self.keep_probability
        other = (1.0 - keep) / (m - 1) if m > 1 else 0.0
        rows_per_chunk = max(1, _CHUNK_ENTRIES // m)
        total = 0.0
        for start in range(0, len(self.values), rows_per_chunk):
            rows = slice(start, start + rows_per_chunk)
            labels = self.values[rows]
            all_bins = pointwise_loss(self.loss, self.outputs[None, :], labels[:, None])
            own_bin = pointwise_loss(self.loss, self.outputs[self.bin_of[rows]], labels)
            per_label = other * (all_bins.sum(axis=1) - own_bin) + keep * own_bin
            total += float(weights[rows] @ np.where(weights[rows] > 0, per_label, 0.0))
        return total

    def randomize(self, labels: np.ndarray, rng: RandomSource = None) -> np.ndarray:
        """Noisy labels; exact draws from 64-bit words, the keep chance rounded down."""
        own = self.bin_of[positions_on_grid(self.values, labels)]
        if self.bin_count == 1:
            return self.outputs[own]
        keep = bernoulli_at_most(self.keep_probability, len(own), rng)
        other = integers_below(self.bin_count - 1, len(own), rng)
        other += other >= own  # skip the own bin: uniform over the m - 1 others
        return self.outputs[np.where(keep, own, other)]


def rr_on_bins(values: object, probs: object, epsilon: float, loss: str) -> RROnBins:
    """The RR-on-Bins mechanism with the smallest expected ``loss`` under prior ``probs``.

    ``values``: strictly increasing label values; ``probs``: their prior weights (normalised
    here); ``loss``: "squared", "absolute" or "poisson".
    """
    loss_name = check_loss(loss)
    grid = check_values(values, loss_name)
    prior = check_prior(probs, len(grid))
    eps = check_epsilon(epsilon)
    if eps > MAX_EPSILON:
        raise InvalidEpsilonError(f"epsilon must be <= {MAX_EPSILON}; got {epsilon}")
    extra_weight = math.expm1(eps)
    support = np.flatnonzero(prior > 0)
    costs = bin_costs_for(loss_name, grid[support], prior[support], extra_weight)
    partition = optimal_partition(costs, extra_weight)
    bounds = np.array(partition.bounds(), dtype=np.int64)
    bin_values = costs.best_values(bounds[:, 0], bounds[:, 1])
    order = np.argsort(bin_values, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    outputs = bin_values[order]
    bin_of = np.empty(len(grid), dtype=np.int64)
    bin_of[support] = rank[np.repeat(np.arange(len(bounds)), bounds[:, 1] - bounds[:, 0] + 1)]
    unseen = np.flatnonzero(prior == 0)
    if unseen.size:
        fit = pointwise_loss(loss_name, outputs[None, :], grid[unseen, None])
        bin_of[unseen] = np.argmin(fit, axis=1)
    return RROnBins(grid, prior, eps, loss_name, outputs, bin_of)
