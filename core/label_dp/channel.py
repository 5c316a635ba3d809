"""Finite mechanisms given by a transition matrix, sampled exactly from integer weights.

Sampling a categorical distribution through floating-point uniforms makes the realised
probabilities differ from the nominal ones in ways nobody checks. Here each row is rounded
once to integer weights summing to ``2**62``; a draw compares one uniform 62-bit integer with
the cumulative weights, so the released distribution is *exactly* ``weights / 2**62``, and
that integer matrix is the one whose privacy loss is verified against epsilon.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.label_dp.errors import InvalidEpsilonError
from core.label_dp.losses import LossName
from core.label_dp.mechanism import channel_expected_loss, privacy_loss
from core.label_dp.randomness import RandomSource, random_words
from core.label_dp.validation import check_prior, positions_on_grid

ROW_BITS = 62
ROW_TOTAL = 1 << ROW_BITS


@dataclass(frozen=True, eq=False)
class QuantisedChannel:
    """Cumulative integer weights per input row; every row ends at exactly ``2**62``."""

    cumulative: np.ndarray

    @classmethod
    def from_matrix(cls, matrix: np.ndarray, epsilon: float) -> QuantisedChannel:
        """Round ``matrix`` to integer weights and refuse if they are not ``epsilon``-DP."""
        weights = np.floor(np.asarray(matrix, dtype=np.float64) * ROW_TOTAL).astype(np.int64)
        deficit = ROW_TOTAL - weights.sum(axis=1)  # small, non-negative: floors only lose mass
        weights[np.arange(len(weights)), np.argmax(weights, axis=1)] += deficit
        realised = privacy_loss(weights.astype(np.float64))
        if realised > epsilon:
            raise InvalidEpsilonError(
                f"quantised channel has privacy loss {realised:.12g} > epsilon {epsilon:.12g}; "
                "the matrix is too close to the bound (calibrate with a small margin)"
            )
        return cls(np.cumsum(weights, axis=1))

    def matrix(self) -> np.ndarray:
        """The realised transition probabilities."""
        weights = np.diff(self.cumulative, axis=1, prepend=0)
        return weights.astype(np.float64) / ROW_TOTAL

    def sample(self, rows: np.ndarray, rng: RandomSource = None) -> np.ndarray:
        """One output column per entry of ``rows``, drawn from that row."""
        draws = (random_words(len(rows), rng) >> np.uint64(64 - ROW_BITS)).astype(np.int64)
        columns = np.empty(len(rows), dtype=np.int64)
        order = np.argsort(rows, kind="stable")
        unique_rows, first = np.unique(rows[order], return_index=True)
        for row, chunk in zip(unique_rows, np.split(order, first[1:]), strict=True):
            columns[chunk] = np.searchsorted(self.cumulative[row], draws[chunk], side="right")
        return columns


@dataclass(frozen=True, eq=False)
class FiniteMechanism:
    """A label mechanism fully described by its (realised) transition matrix."""

    name: str
    values: np.ndarray
    outputs: np.ndarray
    epsilon: float
    loss: LossName
    prior: np.ndarray
    channel: QuantisedChannel

    def transition_matrix(self) -> np.ndarray:
        return self.channel.matrix()

    def expected_loss(self, prior: np.ndarray | None = None) -> float:
        weights = self.prior if prior is None else check_prior(prior, len(self.values), "prior")
        matrix = self.transition_matrix()
        return channel_expected_loss(matrix, self.values, self.outputs, weights, self.loss)

    def randomize(self, labels: np.ndarray, rng: RandomSource = None) -> np.ndarray:
        rows = positions_on_grid(self.values, labels)
        return self.outputs[self.channel.sample(rows, rng)]
