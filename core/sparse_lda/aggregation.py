"""Averaging party contributions through an injected sum, then hard thresholding.

The sum is a parameter because in deployment it is a secure-aggregation protocol (only the
total is ever revealed); the default plain sum serves tests and single-process benchmarks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from core.option_defaults import DEFAULT_THRESHOLD_SCALE
from core.sparse_lda.errors import ShapeError, SparseLDAInputError
from core.sparse_lda.model import LinearDiscriminant
from core.sparse_lda.privacy import BLOCKS_PER_CONTRIBUTION

SumVectors = Callable[[list[np.ndarray]], np.ndarray]


def plain_sum(vectors: list[np.ndarray]) -> np.ndarray:
    """Elementwise sum in the clear: the stand-in for secure aggregation."""
    return np.sum(np.stack(vectors), axis=0)


@dataclass(frozen=True)
class ThresholdRule:
    """Hard threshold ``t = max(scale sqrt(log d / N), multiplier * noise_std)``.

    The first term is the statistical error level of an average over N = sum of party rows.
    Debiased coordinates of true zeros fluctuate with sd about ``sqrt(Theta_jj / N)``, so the
    Gaussian union bound over d coordinates sits at ``sqrt(2 Theta_jj) sqrt(log d / N)``
    (scale 3 when Theta_jj is about 4.5, as in the paper's design); debiasing also leaves a
    residual bias of order ``s log d / n`` per party that averaging does not remove, hence
    the default 4. The second term removes coordinates that are mostly DP noise, by default
    at the union bound ``sqrt(2 log d)`` noise sds; noise_std is public, so this is
    post-processing. ``scale = 0`` and ``noise_multiplier = 0`` turn thresholding off.
    """

    scale: float = DEFAULT_THRESHOLD_SCALE
    noise_multiplier: float | None = None
    """None means ``sqrt(2 log d)``."""

    def __post_init__(self) -> None:
        if self.scale < 0 or (self.noise_multiplier or 0.0) < 0:
            raise SparseLDAInputError(
                f"threshold scale and noise multiplier must be >= 0, got {self.scale} and "
                f"{self.noise_multiplier}"
            )

    def threshold(self, n_features: int, total_rows: int, noise_std: float) -> float:
        log_d = math.log(n_features)
        statistical = self.scale * math.sqrt(log_d / total_rows)
        multiplier = self.noise_multiplier
        if multiplier is None:
            multiplier = math.sqrt(2 * log_d)
        return max(statistical, multiplier * noise_std)


NO_THRESHOLD = ThresholdRule(scale=0.0, noise_multiplier=0.0)


def hard_threshold(vector: np.ndarray, threshold: float) -> np.ndarray:
    """Zero every entry whose magnitude is at most ``threshold``."""
    return np.where(np.abs(vector) > threshold, vector, 0.0)


def sum_contributions(contributions: list[np.ndarray], sum_vectors: SumVectors) -> np.ndarray:
    """``sum_vectors(contributions)``, refusing contributions or a result of the wrong shape."""
    if not contributions:
        raise ShapeError("no contributions to aggregate")
    shapes = {c.shape for c in contributions}
    if len(shapes) != 1:
        raise ShapeError(f"contributions have different shapes {sorted(shapes)}")
    total = np.asarray(sum_vectors(contributions), dtype=np.float64)
    if total.shape != contributions[0].shape:
        raise ShapeError(
            f"sum_vectors returned shape {total.shape}, expected {contributions[0].shape}"
        )
    return total


def model_from_average(
    average: np.ndarray,
    rule: ThresholdRule,
    total_rows: int,
    noise_std: float,
) -> LinearDiscriminant:
    """Split the averaged ``direction | mu1 | mu2`` vector and threshold the direction."""
    if average.ndim != 1 or average.shape[0] % BLOCKS_PER_CONTRIBUTION:
        raise ShapeError(f"averaged vector of shape {average.shape} is not three equal blocks")
    direction, mean_positive, mean_negative = np.split(average, BLOCKS_PER_CONTRIBUTION)
    cut = rule.threshold(direction.shape[0], total_rows, noise_std)
    return LinearDiscriminant(hard_threshold(direction, cut), mean_positive, mean_negative)
